"""Structured output on the gRPC wire: `StructuredOutput` to and from its proto message.

The message's oneof holds the same five kinds as the dataclass; a JSON schema travels as JSON
text. Reading a message raises ValueError naming the field (`structured.<field>`) when its
content is malformed; whether it compiles is the engine's check.
"""

from __future__ import annotations

from meshserve.batching.structured import StructuredOutput
from meshserve.serving.grpc_api.stubs import generation_pb2 as pb


def structured_message(structured: StructuredOutput) -> pb.StructuredOutput:
    """The message of `structured`; bounds have no field on the wire, so a constraint with any
    is refused rather than sent without them (the server's defaults apply on gRPC)."""
    if any(bound is not None for bound in structured.bounds):
        raise ValueError("structured: max_string_length and max_integer_digits do not travel "
                         "over gRPC; set them on the server (--structured-max-string-length, "
                         "--structured-max-integer-digits) or use the HTTP API")
    kind = structured.kind
    if kind == "choice":
        return pb.StructuredOutput(choice=pb.Choice(options=list(structured.choice)))
    return pb.StructuredOutput(**{kind: getattr(structured, kind)})


def structured_from_message(message: pb.StructuredOutput) -> StructuredOutput:
    kind = message.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured: set one of json_schema, json_object, regex, choice, "
                         "grammar")
    if kind == "choice":
        return StructuredOutput(choice=list(message.choice.options))
    return StructuredOutput(**{kind: getattr(message, kind)})
