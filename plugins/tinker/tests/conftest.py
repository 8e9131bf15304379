"""The Tinker server the tests talk to: the embedded SmolLM2-135M with rank-8 adapters, served from a
thread on a free port of 127.0.0.1 with a token, under its own name and a Qwen name the Tinker
Cookbook's tables know (both tokenizers are ChatML)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import pytest

TOKEN = "tml-test-token-0123456789"
ALIAS = "Qwen/Qwen3-4B-Instruct-2507"
os.environ["TINKER_TELEMETRY"] = "0"  # the SDK's telemetry posts nowhere


def tinker_config(model, run_dir) -> dict:
    return {
        "model": {"path": str(model), "lora": {"r": 8, "alpha": 16, "target_modules": "all-linear"}},
        "data": {"source": None},
        "rollout": {"max_tokens": 16},
        "trainer": {"run_dir": str(run_dir), "threads": 2, "seed": 0},
        "tinker": {"model_names": ["smollm2", ALIAS]},
    }


@dataclass
class Served:
    url: str
    service: object
    token: str = TOKEN
    alias: str = ALIAS


@pytest.fixture(scope="module")
def tinker_server(smollm2, tmp_path_factory):
    pytest.importorskip("tinker")
    from hybridrl_tinker.server import make_server
    from hybridrl_tinker.service import TinkerService

    from hybridrl.config import load_config
    from hybridrl.run import build_run

    cfg = load_config(data=tinker_config(smollm2, tmp_path_factory.mktemp("tinker") / "run"))
    run = build_run(cfg, "tinker", data=False)
    service = TinkerService(run, cfg.section("tinker"), "smollm2")
    http = make_server(service, "127.0.0.1", 0, TOKEN, cfg.section("tinker"))
    threading.Thread(target=http.serve_forever, daemon=True).start()
    yield Served(f"http://127.0.0.1:{http.server_address[1]}", service)
    http.shutdown()
    service.close()
    run.close()
