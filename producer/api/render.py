"""Stored results as the Tinker SDK expects them: protobuf for samples and forward/backward, JSON otherwise."""

from fastapi.responses import JSONResponse, Response

from producer.api import proto
from producer.api.http_errors import ApiError
from schemas import Result


def render(result: Result, note: dict) -> Response | dict:
    """`note` is what the API remembered at submit time (a sync's path or sampling session id)."""
    match result.type:
        case "error":
            category = "user" if result.status < 500 else "server"
            return JSONResponse({"error": f"{result.code}: {result.error}", "category": category})
        case "sample":
            return Response(proto.encode_sample(result), media_type=proto.MEDIA_TYPE)
        case "forward_backward":
            return Response(proto.encode_forward_backward(result), media_type=proto.MEDIA_TYPE)
        case "create_model":
            return {"model_id": result.model_id, "type": "create_model"}
        case "optim_step":
            return {"metrics": result.metrics}
        case "weight_sync":
            return {"type": "save_weights_for_sampler", "path": note.get("path"),
                    "sampling_session_id": note.get("sampling_session_id")}
        case "save_state":
            return {"path": note["path"], "type": "save_weights"}
        case "create_custom_loss":
            return {"loss_id": result.loss_id, "type": "create_custom_loss"}
        case "load_state":
            return {"model_id": result.model_id, "path": result.path, "type": "load_weights"}
    raise ApiError(500, f"cannot render a {result.type} result", "internal_error")
