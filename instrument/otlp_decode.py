"""Decoding OTLP/HTTP trace payloads (protobuf and JSON) into plain span records.

An ``ExportTraceServiceRequest`` arrives either as binary protobuf
(``Content-Type: application/x-protobuf``) or in the OTLP JSON encoding
(``application/json``), optionally gzip-compressed. Both are decoded with the
message classes of ``opentelemetry-proto`` (JSON after turning its hex trace
and span ids into the base64 that the protobuf JSON mapping expects) and
flattened into :class:`OtlpSpan` values. Anything malformed raises
:class:`PayloadError` (a ``ValueError``) with a one-sentence message.
"""

from __future__ import annotations

import base64
import json
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["OtlpSpan", "OtlpEvent", "PayloadError", "decode_request", "decompress", "PROTOBUF", "JSON",
           "response_body", "error_body"]

PROTOBUF = "application/x-protobuf"
JSON = "application/json"

_STATUS_CODE_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR
_INVALID_ARGUMENT = 3  # google.rpc.Code.INVALID_ARGUMENT


class PayloadError(ValueError):
    """The request body is not a valid OTLP trace export; the message says why."""


@dataclass(frozen=True, slots=True)
class OtlpSpan:
    """One received span, flattened (times: Unix ns as sent)."""

    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    start_unix_ns: int
    end_unix_ns: int
    attributes: Mapping[str, Any] = field(default_factory=dict)
    """String, bool, int and float attribute values, and arrays of them as tuples; maps are left out."""
    is_error: bool = False
    status_message: str = ""
    parent_span_id: str = ""
    """16 hex digits; empty for a root span."""
    resource: Mapping[str, Any] = field(default_factory=dict)
    """The attributes of the resource that sent the span (the traced process), as :attr:`attributes`."""
    events: tuple[OtlpEvent, ...] = ()


@dataclass(frozen=True, slots=True)
class OtlpEvent:
    """One span event (time: Unix ns as sent)."""

    name: str
    time_unix_ns: int
    attributes: Mapping[str, Any] = field(default_factory=dict)


def _proto() -> Any:
    try:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise ImportError("OTLP ingest needs the opentelemetry-proto package "
                          "(pip install opentelemetry-proto)") from e
    return trace_service_pb2


def decompress(body: bytes, encoding: str, *, max_bytes: int) -> bytes:
    """Undo ``Content-Encoding`` (``gzip``, ``deflate`` or none), refusing more than ``max_bytes``."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise PayloadError(f"unsupported Content-Encoding {encoding!r}; use gzip, deflate or none")
    d = zlib.decompressobj(wbits=47 if encoding == "gzip" else 15)  # 47: gzip or zlib header
    try:
        out = d.decompress(body, max_bytes + 1)
    except zlib.error as e:
        raise PayloadError(f"body is not valid {encoding} data: {e}") from None
    if len(out) > max_bytes:
        raise PayloadError(f"decompressed body is over the limit of {max_bytes} bytes")
    return out


def _hex_to_b64(value: Any, what: str, num_bytes: int) -> str:
    if not isinstance(value, str):
        raise PayloadError(f"{what} must be a hex string, got {type(value).__name__}")
    if value == "":
        return ""
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise PayloadError(f"{what} {value[:40]!r} is not hex") from None
    if len(raw) != num_bytes:
        raise PayloadError(f"{what} must be {2 * num_bytes} hex digits, got {len(value)}")
    return base64.b64encode(raw).decode()


def _fix_json_ids(obj: Any) -> None:
    """OTLP JSON carries ids as hex; the protobuf JSON mapping wants base64 (in place)."""
    if not isinstance(obj, dict):
        raise PayloadError("body must be a JSON object (an ExportTraceServiceRequest)")
    for rs in _list(obj.get("resourceSpans"), "resourceSpans"):
        for ss in _list(_dict(rs, "resourceSpans[]").get("scopeSpans"), "scopeSpans"):
            for span in _list(_dict(ss, "scopeSpans[]").get("spans"), "spans"):
                span = _dict(span, "spans[]")
                for key, n in (("traceId", 16), ("spanId", 8), ("parentSpanId", 8)):
                    if key in span:
                        span[key] = _hex_to_b64(span[key], key, n)
                for link in _list(span.get("links"), "links"):
                    link = _dict(link, "links[]")
                    for key, n in (("traceId", 16), ("spanId", 8)):
                        if key in link:
                            link[key] = _hex_to_b64(link[key], key, n)


def _list(value: Any, what: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise PayloadError(f"{what} must be a list, got {type(value).__name__}")
    return value


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise PayloadError(f"{what} must be an object, got {type(value).__name__}")
    return value


def _parse(body: bytes, content_type: str) -> Any:
    pb = _proto()
    from google.protobuf import json_format
    from google.protobuf.message import DecodeError

    msg = pb.ExportTraceServiceRequest()
    if content_type == PROTOBUF:
        try:
            msg.ParseFromString(body)
        except (DecodeError, ValueError, RuntimeError, RecursionError) as e:
            raise PayloadError(f"body is not a protobuf ExportTraceServiceRequest: {e}") from None
        return msg
    try:
        obj = json.loads(body)
    except RecursionError:
        raise PayloadError("body is not valid JSON: it is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise PayloadError(f"body is not valid JSON: {e}") from None
    _fix_json_ids(obj)
    try:
        json_format.ParseDict(obj, msg, ignore_unknown_fields=True)
    except RecursionError:
        raise PayloadError("JSON is not an ExportTraceServiceRequest: it is nested too deeply") from None
    except (json_format.ParseError, ValueError, TypeError, AttributeError, KeyError) as e:
        raise PayloadError(f"JSON is not an ExportTraceServiceRequest: {e}") from None
    return msg


_MAX_ARRAY = 1 << 16  # longest array attribute kept (one value per output token)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind in ("string_value", "bool_value", "int_value", "double_value"):
        return getattr(v, kind)
    if kind == "array_value" and len(v.array_value.values) <= _MAX_ARRAY:
        items = tuple(_scalar(x) for x in v.array_value.values)
        return None if any(x is None for x in items) else items
    return None


def _scalar(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind in ("string_value", "bool_value", "int_value", "double_value") else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: val for kv in kvs if (val := _value(kv.value)) is not None}


def decode_request(body: bytes, content_type: str) -> list[OtlpSpan]:
    """Every span of an ``ExportTraceServiceRequest`` body.

    ``content_type``: :data:`PROTOBUF` or :data:`JSON` (parameters such as
    ``; charset=utf-8`` are ignored). Raises :class:`PayloadError` for another
    content type or a malformed body.
    """
    media = content_type.split(";", 1)[0].strip().lower()
    if media not in (PROTOBUF, JSON):
        raise PayloadError(f"unsupported Content-Type {content_type!r}; send {PROTOBUF} or {JSON}")
    msg = _parse(body, media)
    out = []
    for rs in msg.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                events = tuple(OtlpEvent(e.name, int(e.time_unix_nano), _attrs(e.attributes)) for e in s.events)
                out.append(OtlpSpan(
                    name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    start_unix_ns=int(s.start_time_unix_nano), end_unix_ns=int(s.end_time_unix_nano),
                    attributes=_attrs(s.attributes), is_error=s.status.code == _STATUS_CODE_ERROR,
                    status_message=s.status.message, parent_span_id=s.parent_span_id.hex(), resource=resource,
                    events=events))
    return out


def response_body(media: str, *, rejected_spans: int = 0, message: str = "") -> bytes:
    """An ``ExportTraceServiceResponse`` in the request's encoding: empty (full success), or
    with ``partial_success`` saying how many spans were rejected and why."""
    if media == PROTOBUF:
        pb = _proto()
        if not rejected_spans:
            return pb.ExportTraceServiceResponse().SerializeToString()
        partial = pb.ExportTracePartialSuccess(rejected_spans=rejected_spans, error_message=message)
        return pb.ExportTraceServiceResponse(partial_success=partial).SerializeToString()
    if not rejected_spans:
        return b"{}"
    return json.dumps({"partialSuccess": {"rejectedSpans": str(rejected_spans), "errorMessage": message}}).encode()


def error_body(media: str, message: str) -> tuple[bytes, str]:
    """A ``google.rpc.Status`` (INVALID_ARGUMENT) with ``message``, as (body, content type).

    Protobuf-encoded for protobuf requests when ``googleapis-common-protos`` is
    installed; JSON otherwise.
    """
    if media == PROTOBUF:
        try:
            from google.rpc import status_pb2

            return status_pb2.Status(code=_INVALID_ARGUMENT, message=message).SerializeToString(), PROTOBUF
        except ImportError:
            pass
    return json.dumps({"code": _INVALID_ARGUMENT, "message": message}).encode(), JSON
