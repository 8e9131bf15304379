"""The agent loop the gateway tests drive: the real hf engine, recording what each call was asked
and answered, behind the run's engine session."""

import pytest
import torch

from hybridrl import plugins
from hybridrl.agents import AgentLoop
from hybridrl.components import RunContext
from hybridrl.models import end_token_ids, load_tokenizer
from hybridrl.session import EngineSession


class Recording:
    """The real hf engine, recording each call's prompts and answers."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, sampling):
        out = self.engine.generate(prompts, sampling)
        self.calls.append((prompts, out))
        return out

    def seeds_each_request(self):
        return False

    def updates_in_flight(self):
        return False


@pytest.fixture(scope="session")
def recorded_loop():
    """``(model, run_dir, rollout, agent) -> (ctx, engine, loop)``: an agent loop over the hf engine of
    ``model`` (``engine.calls``: what it was asked and answered), its environment set by the test."""

    def build(model, run_dir, rollout, agent):
        tok = load_tokenizer(model)
        ctx = RunContext(model, tok, torch.device("cpu"), torch.float32, 0, run_dir)
        hf = plugins.lookup("rollout engine", "hf")
        engine = Recording(hf(hf.Options(), ctx))
        loop = AgentLoop(EngineSession(engine, rollout), None, agent, rollout, tok, end_token_ids(model, tok))
        return ctx, engine, loop

    return build
