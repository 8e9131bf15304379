"""hybridrl_tinker.wire against the real tinker SDK, unmodified: request bodies made by the SDK's own encoder
(tinker/proto/request_conv.py, as resources/training.py posts them) decode to the SDK's values, the bytes of
forward_backward_output and sample_response decode with the SDK's own decoders (tinker/proto/response_conv.py)
to the values sent, and malformed bodies raise WireError saying what is wrong."""

import random
import struct

import numpy as np
import pytest
import torch

pytest.importorskip("tinker")

from hybridrl_tinker.wire import (  # noqa: E402
    Datum,
    WireError,
    forward_backward_output,
    read_forward_backward,
    sample_response,
)
from tinker import types  # noqa: E402
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response  # noqa: E402


def sdk_body(data, loss_fn="ppo", config=None, forward_only=False, seq_id=7, model_id="model-1"):
    """The body AsyncTrainingResource.forward_backward posts (before optional zstd)."""
    fb_input = types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config)
    request = types.ForwardBackwardRequest(forward_backward_input=fb_input, model_id=model_id, seq_id=seq_id)
    message = forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return message.SerializeToString()


def sdk_data():
    """Three datums covering the shapes and dtypes a client sends."""
    sparse_weights = torch.zeros(4, 5)
    sparse_weights[0, 1], sparse_weights[2, 4], sparse_weights[3, 0] = 0.5, -1.5, 2.0
    sparse_targets = torch.zeros(3, 6, dtype=torch.int64)
    sparse_targets[1, 2] = 42
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
            loss_fn_inputs={
                "target_tokens": [2, 3, 4, 151_000],  # a list: the SDK makes it int64
                "weights": np.array([1.0, 1.0, -0.5, 0.0], dtype=np.float32),
                "advantages": torch.tensor([0.25, -0.75, 1.5, -2.0]),
                "logprobs": types.TensorData(data=[-0.5, -1.25, -3.0, -0.125], dtype="float32", shape=[4]),
            },
        ),
        types.Datum(
            model_input=types.ModelInput(
                chunks=[
                    types.EncodedTextChunk(tokens=[10, 11]),
                    types.EncodedTextChunk(tokens=[]),
                    types.EncodedTextChunk(tokens=[2**31 - 1, 0, 12]),
                ]
            ),
            loss_fn_inputs={
                "target_tokens": np.arange(10, dtype=np.int64).reshape(5, 2),  # 2-D, dense
                "weights": sparse_weights,  # 2-D torch: the SDK sends it as sparse CSR
            },
        ),
        types.Datum(
            model_input=types.ModelInput.from_ints([9]),
            loss_fn_inputs={"target_tokens": sparse_targets, "weights": [-3.5]},
        ),
    ]


def test_requests_from_the_sdk_decode_to_its_values():
    data = sdk_data()
    assert data[1].loss_fn_inputs["weights"].sparse_crow_indices is not None  # the sparse path is exercised
    assert data[2].loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    body = sdk_body(data, loss_fn="ppo", config={"clip_low_threshold": 0.8, "mode": "token", "kl": 3})
    request = read_forward_backward(body)

    assert (request.model_id, request.seq_id, request.loss_fn, request.forward_only) == ("model-1", 7, "ppo", False)
    assert request.config == {"clip_low_threshold": 0.8, "mode": "token", "kl": 3.0}
    assert [d.tokens for d in request.data] == [[1, 2, 3, 4], [10, 11, 2**31 - 1, 0, 12], [9]]
    for ours, sdk in zip(request.data, data, strict=True):
        assert isinstance(ours, Datum)
        assert ours.tokens == sdk.model_input.to_ints()
        assert sorted(ours.inputs) == sorted(sdk.loss_fn_inputs)
        for name, tensor_data in sdk.loss_fn_inputs.items():
            expected = tensor_data.to_torch()
            assert ours.inputs[name].dtype == expected.dtype, name
            assert ours.inputs[name].shape == expected.shape, name
            assert torch.equal(ours.inputs[name], expected), name

    first, second, third = request.data
    assert first.inputs["target_tokens"].tolist() == [2, 3, 4, 151_000]
    assert first.inputs["target_tokens"].dtype == torch.int64
    assert first.inputs["weights"].tolist() == [1.0, 1.0, -0.5, 0.0]
    assert first.inputs["advantages"].tolist() == [0.25, -0.75, 1.5, -2.0]
    assert first.inputs["logprobs"].tolist() == [-0.5, -1.25, -3.0, -0.125]
    assert second.inputs["target_tokens"].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    weights = torch.zeros(4, 5)
    weights[0, 1], weights[2, 4], weights[3, 0] = 0.5, -1.5, 2.0
    assert torch.equal(second.inputs["weights"], weights)
    assert third.inputs["target_tokens"].shape == (3, 6)
    assert third.inputs["target_tokens"].sum().item() == 42 and third.inputs["target_tokens"][1, 2].item() == 42
    assert third.inputs["weights"].tolist() == [-3.5]


def test_forward_only_negative_seq_id_and_legacy_config():
    body = sdk_body(sdk_data()[:1], loss_fn="cross_entropy", forward_only=True, seq_id=-5, model_id="ü")
    request = read_forward_backward(body)
    assert (request.forward_only, request.seq_id, request.model_id, request.loss_fn) == (True, -5, "ü", "cross_entropy")
    assert request.config == {}
    # a client from before loss_fn_config_v2 sends the legacy map only
    message = pb.ForwardBackwardRequest(loss_fn="ppo")
    message.loss_fn_config["clip_high_threshold"] = 1.25
    assert read_forward_backward(message.SerializeToString()).config == {"clip_high_threshold": 1.25}


def test_other_dtypes_unknown_fields_and_unpacked_shapes():
    message = pb.ForwardBackwardRequest(loss_fn="ppo")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = struct.pack("<2i", 5, -1)
    bf16 = torch.tensor([1.5, -2.0, 0.0], dtype=torch.bfloat16)
    datum.loss_fn_inputs["w"].CopyFrom(pb.Tensor(dense=bf16.view(torch.int16).numpy().tobytes(), dtype=4, shape=[3]))
    i32 = struct.pack("<3i", 7, -8, 9)
    datum.loss_fn_inputs["t"].CopyFrom(pb.Tensor(dense=i32, dtype=pb.DTYPE_INT32, shape=[3, 1]))
    span = datum.model_input_spans.add().sampled_tokens
    span.sequence_id, span.offset, span.length = "s", 0, 2
    datum.loss_fn_inputs["noshape"].CopyFrom(pb.Tensor(dense=struct.pack("<2f", 1, 2), dtype=pb.DTYPE_FLOAT32))
    body = message.SerializeToString()
    # unknown fields of every wire type, which a newer client may send
    body += b"\xf8\x06\x96\x01" + b"\x82\x07\x03abc" + b"\x8d\x07\x01\x02\x03\x04" + b"\x91\x07" + bytes(8)
    # a tensor whose shape comes unpacked (wire type 0 per element), as proto parsers must accept
    tensor = b"\x0a\x10" + struct.pack("<4f", 1, 2, 3, 4) + b"\x18\x01" + b"\x20\x02\x20\x02"
    entry = b"\x0a\x01u\x12" + bytes([len(tensor)]) + tensor
    body += b"\x1a" + bytes([len(entry) + 2]) + b"\x12" + bytes([len(entry)]) + entry

    parsed = pb.ForwardBackwardRequest.FromString(body)  # protobuf itself reads the hand-made bytes the same way
    assert list(parsed.data[1].loss_fn_inputs["u"].shape) == [2, 2] and parsed.loss_fn == "ppo"
    request = read_forward_backward(body)
    first, second = request.data
    assert first.tokens == [5, -1]
    assert first.inputs["w"].dtype == torch.float32 and first.inputs["w"].tolist() == [1.5, -2.0, 0.0]
    assert first.inputs["t"].dtype == torch.int64 and first.inputs["t"].tolist() == [[7], [-8], [9]]
    assert first.inputs["noshape"].tolist() == [1.0, 2.0]
    assert second.tokens == [] and second.inputs["u"].tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_forward_backward_output_decodes_with_the_sdk():
    logprobs = [torch.tensor([-0.5, -1.25, -2.0]), torch.zeros(0), torch.tensor([-1.0, -0.1, -0.2, -3.0, 0.0])]
    topk = [torch.arange(6, dtype=torch.int32).reshape(3, 2), torch.zeros(0, 2, dtype=torch.int64),
            torch.tensor([[7, -8]])]  # fmt: skip
    outputs = [{"logprobs": lp.double(), "topk": k} for lp, k in zip(logprobs, topk, strict=True)]
    metrics = {"loss:sum": 1.25, "tokens:sum": 8.0, "ratio:mean": -0.1}
    result = deserialize_forward_backward_output(forward_backward_output(outputs, metrics))

    assert result.loss_fn_output_type == "ArrayRecord"
    assert result.metrics == metrics
    assert len(result.loss_fn_outputs) == 3
    for output, lp, k in zip(result.loss_fn_outputs, logprobs, topk, strict=True):
        assert (output["logprobs"].dtype, output["logprobs"].shape) == ("float32", [len(lp)])
        assert output["logprobs"].tolist() == lp.tolist()
        assert (output["topk"].dtype, output["topk"].shape) == ("int64", list(k.shape))
        assert output["topk"].tolist() == k.tolist()
    assert result.loss_fn_outputs[0]["logprobs"].tolist() == [-0.5, -1.25, -2.0]
    assert result.loss_fn_outputs[2]["topk"].tolist() == [[7, -8]]
    # the SDK combines chunked requests by the reduction in each metric's name
    combined = combine_fwd_bwd_output_results([result, result]).metrics
    assert combined == {"loss:sum": 2.5, "tokens:sum": 16.0, "ratio:mean": pytest.approx(-0.1)}

    empty = deserialize_forward_backward_output(forward_backward_output([{}, {}], {}))
    assert (empty.loss_fn_outputs, empty.metrics) == ([{}, {}], {})


def test_forward_backward_output_refuses_server_bugs():
    with pytest.raises(ValueError, match="'loss' must be 'name:reduction'"):
        forward_backward_output([], {"loss": 1.0})
    with pytest.raises(ValueError, match="'loss:avg' must be"):
        forward_backward_output([], {"loss:avg": 1.0})
    with pytest.raises(ValueError, match=r"datum 1 has outputs \['x'\], datum 0 has \['logprobs'\]"):
        forward_backward_output([{"logprobs": torch.zeros(1)}, {"x": torch.zeros(1)}], {})


def test_ragged_outputs_come_as_several_records_the_sdk_joins():
    """Top-K logprobs beside plain ones: a record per run of datums of one trailing shape, in order."""
    outs = [{"k": torch.arange(6.0).reshape(2, 3)}, {"k": torch.arange(8.0).reshape(2, 4)}, {"k": torch.ones(3, 4)}]
    decoded = deserialize_forward_backward_output(forward_backward_output(outs, {"loss:sum": 1.0}))
    got = [o["k"].to_torch() for o in decoded.loss_fn_outputs]
    assert [tuple(g.shape) for g in got] == [(2, 3), (2, 4), (3, 4)]
    assert all(torch.equal(g, o["k"]) for g, o in zip(got, outs))


def test_sample_response_decodes_with_the_sdk():
    sequences = [
        ([5, 6, 7], [-0.5, -1.25, -2.0], "stop"),
        ([], [], "length"),
        ([2**31 - 1, 0], [-0.0, -3.5], "length"),
        ([3], None, "stop"),
    ]
    result = deserialize_sample_response(sample_response(sequences, prompt_logprobs=[None, -1.5, -0.25]))
    assert [s.tokens for s in result.sequences] == [[5, 6, 7], [], [2**31 - 1, 0], [3]]
    assert [s.stop_reason for s in result.sequences] == ["stop", "length", "length", "stop"]
    # the SDK reads empty logprobs bytes as "not requested": a 0-token sequence has None, like one sent without
    assert [s.logprobs for s in result.sequences] == [[-0.5, -1.25, -2.0], None, [-0.0, -3.5], None]
    assert result.prompt_logprobs == [None, -1.5, -0.25]
    assert deserialize_sample_response(sample_response(sequences[:1])).prompt_logprobs is None

    with pytest.raises(ValueError, match="stop reason 'eos'"):
        sample_response([([1], [0.0], "eos")])
    with pytest.raises(ValueError, match="1 logprobs for 2 tokens"):
        sample_response([([1, 2], [0.0], "stop")])


def request_with(tensor: pb.Tensor, datums_before: int = 0) -> bytes:
    message = pb.ForwardBackwardRequest(loss_fn="ppo")
    for _ in range(datums_before):
        message.data.add().model_input.add().encoded_text.tokens = struct.pack("<i", 1)
    message.data.add().loss_fn_inputs["weights"].CopyFrom(tensor)
    return message.SerializeToString()


def test_malformed_tensors():
    short = pb.Tensor(dense=struct.pack("<3f", 1, 2, 3), dtype=pb.DTYPE_FLOAT32, shape=[4])
    expected = "datum 2: tensor 'weights' has 12 bytes of data for shape [4] float32 (16 expected)"
    with pytest.raises(WireError) as error:
        read_forward_backward(request_with(short, datums_before=2))
    assert str(error.value) == expected
    with pytest.raises(WireError, match=r"datum 0: tensor 'weights' has unknown dtype 7 \(known: 1 float32"):
        read_forward_backward(request_with(pb.Tensor(dense=bytes(4), dtype=7, shape=[1])))
    with pytest.raises(WireError, match="unknown dtype 0"):
        read_forward_backward(request_with(pb.Tensor(dense=bytes(4), shape=[1])))
    with pytest.raises(WireError, match=r"negative dimension in shape \[-1, 4\]"):
        read_forward_backward(request_with(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[-1, 4])))
    csr = pb.SparseCsr(values=struct.pack("<f", 1), crow_indices=struct.pack("<3q", 0, 1, 1))
    csr.col_indices = struct.pack("<q", 5)
    with pytest.raises(WireError, match=r"datum 0: tensor 'weights': a column index is outside \[0, 5\)"):
        read_forward_backward(request_with(pb.Tensor(sparse_csr=csr, dtype=pb.DTYPE_FLOAT32, shape=[2, 5])))
    csr.crow_indices = struct.pack("<3q", 0, 2, 1)
    with pytest.raises(WireError, match="crow_indices must start at 0 and never decrease"):
        read_forward_backward(request_with(pb.Tensor(sparse_csr=csr, dtype=pb.DTYPE_FLOAT32, shape=[2, 5])))


def test_absurd_shapes_fail_before_allocating():
    huge = [
        pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2**20, 2**20]),  # 2**40 elements, no data
        pb.Tensor(sparse_csr=pb.SparseCsr(crow_indices=struct.pack("<2q", 0, 0)), dtype=pb.DTYPE_FLOAT32,
                  shape=[1, 2**40]),  # an empty sparse tensor that would densify to 4 TiB
        pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2**62, 2**62, 0]),  # 0 elements, but overflows torch's numel
    ]  # fmt: skip
    for tensor in huge:  # the shape check's own error: raised before anything of that size is allocated
        with pytest.raises(WireError, match=r"datum 0: tensor 'weights': shape \[.*\] asks for \d+ elements, over the"):
            read_forward_backward(request_with(tensor))
    # the budget is for the whole request: two tensors of 6 elements do not fit in 10
    message = pb.ForwardBackwardRequest()
    for _ in range(2):
        message.data.add().loss_fn_inputs["x"].CopyFrom(pb.Tensor(dense=bytes(24), dtype=1, shape=[2, 3]))
    assert len(read_forward_backward(message.SerializeToString(), max_elements=12).data) == 2
    with pytest.raises(WireError, match=r"datum 1: tensor 'x': shape \[2, 3\] asks for 6 elements, over the 4 left$"):
        read_forward_backward(message.SerializeToString(), max_elements=10)


def test_image_and_audio_chunks_are_refused():
    chunks = [types.EncodedTextChunk(tokens=[1]), types.ImageChunk(data=b"\x89PNG", format="png")]
    image = types.ModelInput(chunks=chunks)
    with pytest.raises(WireError, match="datum 1: chunk 1 is an image chunk: image and audio inputs are not served"):
        read_forward_backward(sdk_body([sdk_data()[0], types.Datum(model_input=image)]))
    audio = types.ModelInput(chunks=[types.DmelChunk(dmel=b"\x00\x01")])
    with pytest.raises(WireError, match="datum 0: chunk 0 is a dmel"):
        read_forward_backward(sdk_body([types.Datum(model_input=audio)]))
    message = pb.ForwardBackwardRequest()
    message.data.add().model_input.add()  # an empty chunk, as a chunk type this codec does not know reads
    with pytest.raises(WireError, match="datum 0: chunk 0 holds no encoded_text"):
        read_forward_backward(message.SerializeToString())


def test_truncated_and_garbage_bodies():
    body = sdk_body(sdk_data(), config={"mode": "token"}, forward_only=True)
    assert read_forward_backward(body).forward_only  # the body ends with forward_only's varint
    with pytest.raises(WireError, match="request: truncated message"):
        read_forward_backward(body[:-1])
    with pytest.raises(WireError, match=r"request: truncated message \(field 3 needs \d+ bytes"):
        read_forward_backward(body[: len(body) // 2])
    cases = {
        b"\xff" * 11: "request: malformed varint",
        b"\x0f": "request: malformed message (wire type 7 on field 1)",
        b"\x00\x01": "request: malformed message (field number 0)",
        b"\x0a\x02\xff\xfe": "model_id: a string field is not valid UTF-8",
        b"\x1a\x03\x0a\x01\xff": "datum 0: chunk 0: truncated message (a varint runs past the end)",
    }
    for garbage, message in cases.items():
        with pytest.raises(WireError, match=message.replace("(", r"\(").replace(")", r"\)")):
            read_forward_backward(garbage)


def test_random_and_mutated_bodies_raise_only_wire_error():
    rng = random.Random(0)
    body = sdk_body(sdk_data(), config={"mode": "token", "clip_low_threshold": 0.8})
    bodies = [rng.randbytes(rng.randrange(1, 300)) for _ in range(300)]
    for _ in range(700):
        mutated = bytearray(body)
        for _ in range(rng.randrange(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        bodies.append(bytes(mutated))
    errors = 0
    for candidate in bodies:
        try:
            read_forward_backward(candidate, max_elements=1 << 16)
        except WireError:
            errors += 1
    assert errors > 100  # most of them are malformed, and every failure was a WireError
