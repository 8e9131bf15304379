"""Python code in hybridrl: a reward function from a file, a tool that runs the model's code, and
one that does arithmetic.

Reward function ``python`` (:mod:`.reward`): verl's ``compute_score`` or a TRL reward function,
called in worker processes with a time limit per call (:mod:`.function_pool`). Tool ``python``
(:mod:`.tool`): the model's code in a WebAssembly sandbox (:mod:`.sandbox`; the ``sandbox`` extra
installs wasmtime). Tool ``calculator`` (:mod:`.calculator`): arithmetic read as a syntax tree.

The components are imported when registered, not with the package: the reward's worker processes
(``python -m hybridrl_reward_python.function_pool``) import this package and nothing more of it.
"""

from __future__ import annotations

from hybridrl.hookspecs import hookimpl

__version__ = "0.1.0"


@hookimpl
def register_reward_functions(register):
    from hybridrl_reward_python.reward import PythonReward

    register("python", PythonReward)


@hookimpl
def register_tools(register):
    from hybridrl_reward_python.calculator import Calculator
    from hybridrl_reward_python.tool import PythonTool

    register("calculator", Calculator)
    register("python", PythonTool)
