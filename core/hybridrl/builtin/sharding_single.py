"""Sharding strategy ``single``: the whole model on this process's one device."""

from __future__ import annotations

from hybridrl.components import ShardingStrategy
from hybridrl.hookspecs import hookimpl


class SingleDevice(ShardingStrategy):
    def wrap(self, model, trainable=True):
        return model.to(self.ctx.device)

    def full_tensors(self, model):
        # tied weights appear once, under the name the HF state dict uses
        yield from model.state_dict().items()


@hookimpl
def register_sharding_strategies(register):
    register("single", SingleDevice)
