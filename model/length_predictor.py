"""The learned output-length predictor: a tiny MLP on `LengthFeatures`, trained with optax on
completed requests, that implements `meshserve.batching.length.LengthPredictor`.

The model. Features are standardised with the training set's mean and (floored) standard deviation,
then one GELU hidden layer (or none: `hidden=0` is linear) gives Q raw outputs. Output 0 is the
log length at the lowest quantile; each later quantile adds `softplus(raw)`, a non-negative
increment, so quantiles never cross. The loss is the pinball (quantile) loss of all Q quantiles at
once, on log lengths: log is monotone, so a quantile of log length is the log of the quantile.
Predictions are exponentiated and clipped to the request's bounds (`LengthFeatures.bounds`).

Data. `observe` appends (features, output length) to a ring buffer of `capacity` samples; requests
whose length is known in advance (ignore_eos, no stops) teach nothing and are skipped. Until
`min_samples` samples have been logged and trained on, predictions come from `PriorPredictor`.

Training runs off the hot path, on a background thread. Why a thread rather than a
`maybe_retrain()` the engine calls between steps: a retrain takes tens to hundreds of
milliseconds, which would stall every running request for a step; on a thread the engine's steps
keep going (XLA releases the GIL while it runs). Training and prediction run on the host CPU
device, so they never queue behind or delay the serving steps on an accelerator. `observe` only
appends under a lock and, once `retrain_every` new samples have arrived, wakes the worker. The
worker trains from scratch on a snapshot of the buffer and swaps the fitted model in with one
reference assignment, so `predict` sees the old model or the new one, never a mix. If training
fails, the error is logged and kept, the worker stops, and the next `predict` or `observe` raises
it: a predictor that silently stopped learning would be worse. `background=False` trains only
when `retrain()` is called (evaluation, tests).

Fixed shapes, so nothing recompiles in steady state: training always sees the whole ring buffer
[capacity, F] and the valid count as an argument, and draws minibatches of `batch_size` rows
inside one jitted `lax.scan`; prediction pads each batch to a power-of-two bucket between 8 and
`max_batch` (larger batches go in chunks). So there is one training program and at most
log2(max_batch / 8) + 1 prediction programs.

File format (`save`, `load`): one `.npz` archive holding `meta`, a JSON string with the format
name, `VERSION`, the feature config, the quantiles, the hidden width and the number of samples
trained on, and the arrays `mean`, `scale` and `param/<name>`. Loading checks the format, the
version and, when a config is given, that its features, quantiles and width match the file's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
from pathlib import Path
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshserve.batching.length import (DEFAULT_QUANTILES, FeatureConfig, LengthFeatures,
                                       LengthPrediction, PriorPredictor, check_output_len,
                                       check_quantiles, feature_matrix)

FORMAT = "meshserve-length-predictor"
VERSION = 1
_MIN_BUCKET = 8  # smallest prediction batch bucket
_SCALE_FLOOR = 1e-2  # floor on a feature's standard deviation: rare hash buckets stay tame
VALIDATION_EVERY = 5  # every 5th logged sample is held out from training (20%)

log = logging.getLogger(__name__)

Params = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PredictorConfig:
    """The learned predictor's knobs. `features`, `quantiles` and `hidden` define the model and
    are saved with it; `capacity`, `batch_size` and `max_batch` fix the compiled shapes."""

    features: FeatureConfig = FeatureConfig()
    quantiles: tuple[float, ...] = DEFAULT_QUANTILES
    hidden: int = 32  # width of the hidden layer; 0 for a linear model
    min_samples: int = 64  # samples needed before the first training; the prior serves until then
    retrain_every: int = 64  # new samples that wake the background worker
    capacity: int = 4096  # ring buffer of the most recent samples, all trained on
    num_steps: int = 400  # Adam steps per training, from scratch
    eval_every: int = 20  # steps between validation checks; the best check's parameters win
    batch_size: int = 256  # minibatch rows per step, drawn with replacement
    learning_rate: float = 3e-3  # peak; cosine decay to 0 over num_steps
    weight_decay: float = 1e-4
    max_batch: int = 256  # largest prediction bucket, a power of two >= 8
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "quantiles", check_quantiles(self.quantiles))
        for name in ("min_samples", "retrain_every", "capacity", "num_steps", "eval_every",
                     "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_steps % self.eval_every:
            raise ValueError(f"num_steps ({self.num_steps}) must be a multiple of eval_every "
                             f"({self.eval_every})")
        if self.min_samples < VALIDATION_EVERY:
            raise ValueError(f"min_samples must be >= {VALIDATION_EVERY}, so that validation "
                             f"has a sample, got {self.min_samples}")
        if self.hidden < 0:
            raise ValueError(f"hidden must be >= 0 (0: linear), got {self.hidden}")
        if self.min_samples > self.capacity:
            raise ValueError(f"min_samples ({self.min_samples}) must not exceed capacity "
                             f"({self.capacity})")
        is_pow2 = self.max_batch >= _MIN_BUCKET and self.max_batch & (self.max_batch - 1) == 0
        if not is_pow2:
            raise ValueError(f"max_batch must be a power of two >= {_MIN_BUCKET}, "
                             f"got {self.max_batch}")

    def model_fields(self) -> dict:
        """What a saved model must agree on with the config that loads it."""
        return {"features": self.features.to_dict(), "quantiles": list(self.quantiles),
                "hidden": self.hidden}


class Fitted(NamedTuple):
    """A trained model: parameters and the standardisation it was trained with, on the CPU."""

    params: Params
    mean: np.ndarray  # [F]
    scale: np.ndarray  # [F]
    offsets: np.ndarray  # [Q] log-length shifts that calibrate each quantile on validation rows
    num_samples: int


class SampleBuffer:
    """A ring buffer of the last `capacity` (feature vector, output length) samples. Not
    thread-safe by itself: the predictor holds its lock around every call."""

    def __init__(self, capacity: int, num_features: int):
        self.x = np.zeros((capacity, num_features), np.float32)  # [C, F]
        self.y = np.ones(capacity, np.float32)  # [C] output lengths
        self.num_added = 0

    @property
    def size(self) -> int:
        return min(self.num_added, len(self.y))

    def add(self, vector: np.ndarray, output_len: int) -> None:
        row = self.num_added % len(self.y)
        self.x[row], self.y[row] = vector, output_len
        self.num_added += 1

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, int]:
        return self.x.copy(), self.y.copy(), self.size


class LearnedPredictor:
    """Implements `LengthPredictor`; see the module docstring for how and when it trains."""

    def __init__(self, config: PredictorConfig = PredictorConfig(), *, background: bool = True):
        self.config = config
        self.quantiles = config.quantiles
        self.prior = PriorPredictor(config.quantiles)
        self.num_trainings = 0
        # pinball losses of the last training at each validation check: (train, validation)
        self.last_losses: tuple[np.ndarray, np.ndarray] | None = None
        self._fitted: Fitted | None = None  # replaced whole, never mutated
        self._buffer = SampleBuffer(config.capacity, config.features.num_features)
        self._device = jax.devices("cpu")[0]
        self._train_fn = jax.jit(functools.partial(
            _train, optimizer=_optimizer(config), taus=config.quantiles,
            num_steps=config.num_steps, eval_every=config.eval_every,
            batch_size=config.batch_size))
        self._predict_fn = jax.jit(_log_quantiles)
        self._cond = threading.Condition()
        self._num_new = 0  # samples added since the last snapshot
        # samples needed to train: a loaded model is replaced only by one trained on as much data
        self._num_required = config.min_samples
        self._is_pending = self._is_training = self._is_closed = False
        self._error: BaseException | None = None
        self._worker = None
        if background:
            self._worker = threading.Thread(target=self._work, name="length-predictor",
                                            daemon=True)
            self._worker.start()

    # -- the protocol ----------------------------------------------------------------------------

    def predict(self, features: Sequence[LengthFeatures]) -> list[LengthPrediction]:
        """Quantiles for each request: the prior until a model is trained, then the model's."""
        self._raise_if_failed()
        fitted = self._fitted  # one read: a swap during this call does not mix models
        if fitted is None or not features:
            return self.prior.predict(features)
        lengths = self._predict_lengths(fitted, feature_matrix(features))  # [B, Q]
        return [self._prediction(f, row) for f, row in zip(features, lengths)]

    def observe(self, features: LengthFeatures, output_len: int) -> None:
        """Logs one finished request; wakes the worker once `retrain_every` new samples arrived."""
        self._raise_if_failed()
        check_output_len(features, output_len)
        if features.is_length_known:
            return
        with self._cond:
            self._buffer.add(features.vector(), int(output_len))
            self._num_new += 1
            if self._worker is not None and self._is_due():
                self._is_pending = True
                self._cond.notify_all()

    # -- training --------------------------------------------------------------------------------

    @property
    def is_trained(self) -> bool:
        return self._fitted is not None

    @property
    def num_samples(self) -> int:
        """Samples in the buffer now (at most `capacity`)."""
        with self._cond:
            return self._buffer.size

    @property
    def error(self) -> BaseException | None:
        """What made the background worker stop, if it did."""
        return self._error

    def retrain(self) -> bool:
        """Trains on the buffer now, in the calling thread, and swaps the model in. False (and
        nothing trained) while fewer than `min_samples` samples were logged, or, after `load`,
        fewer than the loaded model was trained on (up to `capacity`)."""
        with self._cond:
            if self._buffer.size < self._num_required:
                return False
            x, y, n = self._buffer.snapshot()
            self._num_new = 0
        self._fitted = self._fit(x, y, n)
        self.num_trainings += 1
        return True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Blocks until no training is pending or running (or the worker failed); False on
        timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._error is not None or not (self._is_pending or self._is_training),
                timeout)

    def close(self) -> None:
        """Stops the worker after any training in progress; the model stays usable."""
        with self._cond:
            self._is_closed = True
            self._cond.notify_all()
        if self._worker is not None:
            self._worker.join()

    def _is_due(self) -> bool:
        return (self._num_new >= self.config.retrain_every
                and self._buffer.size >= self._num_required)

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._is_pending or self._is_closed)
                if self._is_closed:
                    return
                self._is_pending, self._is_training = False, True
            try:
                self.retrain()
            except Exception as error:  # kept and re-raised on the serving thread
                log.exception("length predictor training failed; the predictor stops")
                self._error = error
                return
            finally:
                with self._cond:
                    self._is_training = False
                    self._cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"length predictor training failed: {self._error!r}") \
                from self._error

    def _fit(self, x: np.ndarray, y: np.ndarray, n: int) -> Fitted:
        """A model trained from scratch on the first `n` rows of x [C, F] and y [C]: every
        `VALIDATION_EVERY`-th row is held out, to pick the best check and calibrate."""
        mean = x[:n].mean(axis=0)
        scale = np.maximum(x[:n].std(axis=0), _SCALE_FLOOR)
        log_y = np.log(y)
        is_val = (np.arange(len(y)) % VALIDATION_EVERY == VALIDATION_EVERY - 1) & \
            (np.arange(len(y)) < n)  # [C]
        train_rows = np.flatnonzero(~is_val[:n])
        rows = np.zeros(len(y), np.int32)  # [C]: the training rows first, then padding
        rows[:len(train_rows)] = train_rows
        params = init_params(self.config, log_y[train_rows])
        key = jax.random.key(self.config.seed)
        with jax.default_device(self._device):
            params, train_loss, val_loss, log_q = self._train_fn(
                params, (x - mean) / scale, log_y, rows, np.int32(len(train_rows)),
                is_val.astype(np.float32), key)
            self.last_losses = (np.asarray(train_loss), np.asarray(val_loss))
            offsets = calibration_offsets(np.asarray(log_q)[is_val], log_y[is_val],
                                          self.quantiles)
            return Fitted(params, mean, scale, offsets, n)

    # -- prediction ------------------------------------------------------------------------------

    def _predict_lengths(self, fitted: Fitted, x: np.ndarray) -> np.ndarray:
        """[B, Q] predicted lengths for x [B, F], run in padded buckets of fixed shapes."""
        chunks = []
        for start in range(0, len(x), self.config.max_batch):
            chunk = x[start:start + self.config.max_batch]
            padded = np.zeros((prediction_bucket(len(chunk), self.config.max_batch), x.shape[1]),
                              np.float32)
            padded[:len(chunk)] = chunk
            with jax.default_device(self._device):
                log_q = self._predict_fn(fitted.params, (padded - fitted.mean) / fitted.scale)
            log_q = np.asarray(log_q, np.float64)[:len(chunk)] + fitted.offsets  # [b, Q]
            chunks.append(np.exp(log_q))
        return np.concatenate(chunks)

    def _prediction(self, features: LengthFeatures, lengths: np.ndarray) -> LengthPrediction:
        if features.is_length_known:
            return self.prior.predict_one(features)  # exact: every quantile is max_tokens
        return LengthPrediction.clipped(self.quantiles, lengths, features)

    # -- files -----------------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Writes the trained model to `path` (an .npz archive; see the module docstring)."""
        fitted = self._fitted
        if fitted is None:
            raise ValueError("nothing to save: the predictor has not been trained yet")
        meta = {"format": FORMAT, "version": VERSION, **self.config.model_fields(),
                "num_samples": fitted.num_samples}
        arrays = {f"param/{name}": np.asarray(value) for name, value in fitted.params.items()}
        with open(path, "wb") as f:
            np.savez(f, meta=np.array(json.dumps(meta)), mean=fitted.mean, scale=fitted.scale,
                     offsets=fitted.offsets, **arrays)

    @classmethod
    def load(cls, path: str | Path, config: PredictorConfig | None = None, *,
             background: bool = True) -> LearnedPredictor:
        """A predictor serving the model saved at `path`. With `config`, the file's features,
        quantiles and hidden width must match it; without, they are taken from the file."""
        meta, arrays = _read_archive(path)
        config = _config_for(meta, config, path)
        predictor = cls(config, background=background)
        params = {name.removeprefix("param/"): value
                  for name, value in arrays.items() if name.startswith("param/")}
        _check_param_shapes(params, config, path)
        num_samples = int(meta["num_samples"])
        predictor._fitted = Fitted(jax.device_put(params, predictor._device), arrays["mean"],
                                   arrays["scale"], arrays["offsets"], num_samples)
        predictor._num_required = min(max(config.min_samples, num_samples), config.capacity)
        return predictor


# -- the model, pure functions ---------------------------------------------------------------------

def init_params(config: PredictorConfig, log_y: np.ndarray) -> dict[str, np.ndarray]:
    """Seeded initial parameters. The output bias starts at the data's own log-length quantiles
    (the increments through an inverse softplus), so training starts from the marginal
    distribution and only has to learn how features move it."""
    rng = np.random.default_rng(config.seed)
    num_features, num_q = config.features.num_features, len(config.quantiles)
    start = np.quantile(log_y, config.quantiles)
    steps = np.maximum(np.diff(start), 1e-3)
    bias = np.concatenate([start[:1], steps + np.log(-np.expm1(-steps))]).astype(np.float32)
    params = {"out_b": bias}
    width = num_features
    if config.hidden:
        params["hidden_w"] = _glorot(rng, num_features, config.hidden)
        params["hidden_b"] = np.zeros(config.hidden, np.float32)
        width = config.hidden
    params["out_w"] = (0.1 * _glorot(rng, width, num_q)).astype(np.float32)
    return params


def _glorot(rng: np.random.Generator, fan_in: int, fan_out: int) -> np.ndarray:
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32)


def _log_quantiles(params: Params, x: jax.Array) -> jax.Array:
    """[B, Q] log-length quantiles, non-decreasing along Q, from standardised x [B, F]."""
    h = x
    if "hidden_w" in params:
        h = jax.nn.gelu(x @ params["hidden_w"] + params["hidden_b"])  # [B, H]
    raw = h @ params["out_w"] + params["out_b"]  # [B, Q]
    increments = jnp.cumsum(jax.nn.softplus(raw[:, 1:]), axis=1)  # [B, Q-1], >= 0
    return raw[:, :1] + jnp.concatenate([jnp.zeros_like(raw[:, :1]), increments], axis=1)


def pinball_loss(log_q: jax.Array, log_y: jax.Array, taus: Sequence[float], *,
                 reduce: bool = True) -> jax.Array:
    """Pinball loss of log_q [B, Q] against log_y [B] at quantile levels taus [Q], averaged over
    the quantiles: per row [B], or the mean over rows when `reduce`."""
    tau = jnp.asarray(taus, jnp.float32)  # [Q]
    residual = log_y[:, None] - log_q  # [B, Q]
    per_row = jnp.mean(jnp.maximum(tau * residual, (tau - 1.0) * residual), axis=1)  # [B]
    return jnp.mean(per_row) if reduce else per_row


def _optimizer(config: PredictorConfig) -> optax.GradientTransformation:
    schedule = optax.cosine_decay_schedule(config.learning_rate, config.num_steps)
    return optax.adamw(schedule, weight_decay=config.weight_decay)


def _train(params: Params, x: jax.Array, log_y: jax.Array, rows: jax.Array,
           num_train: jax.Array, val_weight: jax.Array, key: jax.Array, *,
           optimizer: optax.GradientTransformation, taus: tuple[float, ...], num_steps: int,
           eval_every: int, batch_size: int):
    """Minibatch training on x [C, F], log_y [C]. Steps draw rows from rows[:num_train]; every
    `eval_every` steps the pinball loss on the rows with val_weight 1 is checked and the best
    parameters so far are kept. Shapes depend only on C, never on the counts.

    Returns the best parameters, the mean training loss and the validation loss of each check
    [num_steps / eval_every], and the best parameters' log quantiles of every row [C, Q].
    """

    def val_loss(params):
        per_row = pinball_loss(_log_quantiles(params, x), log_y, taus, reduce=False)  # [C]
        return jnp.sum(per_row * val_weight) / jnp.sum(val_weight)

    def step(carry, step_key):
        params, opt_state = carry
        batch = rows[jax.random.randint(step_key, (batch_size,), 0, num_train)]  # [batch_size]
        loss, grads = jax.value_and_grad(
            lambda p: pinball_loss(_log_quantiles(p, x[batch]), log_y[batch], taus))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    def check(carry, step_keys):
        params, opt_state, best, best_loss = carry
        (params, opt_state), losses = jax.lax.scan(step, (params, opt_state), step_keys)
        loss = val_loss(params)
        best = jax.tree.map(lambda new, old: jnp.where(loss < best_loss, new, old), params, best)
        return (params, opt_state, best, jnp.minimum(loss, best_loss)), (losses.mean(), loss)

    keys = jax.random.split(key, num_steps).reshape(num_steps // eval_every, eval_every)
    carry = (params, optimizer.init(params), params, val_loss(params))
    (_, _, best, _), (train_losses, val_losses) = jax.lax.scan(check, carry, keys)
    return best, train_losses, val_losses, _log_quantiles(best, x)


def calibration_offsets(log_q: np.ndarray, log_y: np.ndarray,
                        taus: Sequence[float]) -> np.ndarray:
    """[Q] shifts that make each quantile's coverage on held-out rows equal its level: the
    tau quantile of the residuals log_y - log_q[:, j] (quantile recalibration). They undo
    the too-narrow spread an over-fitted model learns from its own training rows."""
    residuals = log_y[:, None] - log_q  # [V, Q]
    return np.array([np.quantile(residuals[:, j], tau) for j, tau in enumerate(taus)])


def prediction_bucket(batch: int, max_batch: int) -> int:
    """The smallest power of two >= batch, at least 8 and at most max_batch."""
    assert 1 <= batch <= max_batch, (batch, max_batch)
    return max(_MIN_BUCKET, 1 << (batch - 1).bit_length())


# -- files -------------------------------------------------------------------------------------------

def _read_archive(path: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} is not a length predictor archive (.npz): {error}") from error
    meta = json.loads(str(arrays.pop("meta"))) if "meta" in arrays else {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} file (format {meta.get('format')!r})")
    if meta.get("version") != VERSION:
        raise ValueError(f"{path} has {FORMAT} version {meta.get('version')}; this code reads "
                         f"version {VERSION}: retrain and save again")
    return meta, arrays


def _config_for(meta: dict, config: PredictorConfig | None, path) -> PredictorConfig:
    """`config` checked against the file, or a default config with the file's model fields."""
    saved = {name: meta[name] for name in ("features", "quantiles", "hidden")}
    if config is None:
        return PredictorConfig(features=FeatureConfig(**saved["features"]),
                               quantiles=tuple(saved["quantiles"]), hidden=saved["hidden"])
    wanted = config.model_fields()
    for name, value in wanted.items():
        if value != saved[name]:
            raise ValueError(f"{path} was trained with {name}={saved[name]} but this predictor "
                             f"is configured with {name}={value}; load it with a matching "
                             f"PredictorConfig or retrain")
    return config


def _check_param_shapes(params: dict, config: PredictorConfig, path) -> None:
    expected = init_params(config, np.zeros(1, np.float32))
    shapes = {name: tuple(np.shape(value)) for name, value in params.items()}
    wanted = {name: value.shape for name, value in expected.items()}
    if shapes != wanted:
        raise ValueError(f"{path} holds parameters {shapes}, expected {wanted}")
