"""The committed protos/epd_pb code is exactly what the .proto sources generate."""

from __future__ import annotations

from pathlib import Path

from protos import generate


def test_committed_code_matches_proto_sources(tmp_path: Path) -> None:
    written = generate.generate(tmp_path)
    assert sorted(p.name for p in written) == generate.generated_names()
    stale = []
    for path in written:
        committed = generate.PACKAGE_DIR / path.name
        if not committed.exists() or committed.read_text() != path.read_text():
            stale.append(path.name)
    assert not stale, f"regenerate with `python -m protos.generate`: {stale} differ"


def test_no_orphan_generated_files() -> None:
    present = {
        p.name
        for p in generate.PACKAGE_DIR.iterdir()
        if p.name.endswith(generate.GENERATED_SUFFIXES)
    }
    assert present == set(generate.generated_names())


def test_generated_package_imports_and_keeps_presence() -> None:
    from protos.epd_pb import bus_pb2, inference_pb2, inference_pb2_grpc

    params = inference_pb2.SamplingParams(top_k=5)
    assert not params.HasField("temperature")  # unset differs from 0.0 (greedy)
    params.temperature = 0.0
    assert params.HasField("temperature")
    request = bus_pb2.PrefillRequest(request_id="r1", sampling=params)
    assert bus_pb2.PrefillRequest.FromString(request.SerializeToString()) == request
    assert hasattr(inference_pb2_grpc, "InferenceServicer")
