"""A verifiers 0.4 environment as its authors write one, for the plugin's tests: a taskset of sums,
a reward (the rubric) on the task, and a harness of its own that talks to the model twice (it asks,
then asks for a check), running in process as verifiers allows (model calls through the endpoint
verifiers gives it). Loaded by id: ``{"taskset": {"id": "sum-check"}}``."""

import re

import httpx
import verifiers.v1 as vf


class SumData(vf.TaskData):
    a: int
    b: int
    answer: int


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return 1.0 if numbers and int(numbers[-1]) == task.answer else 0.0

    @vf.reward(weight=0.5)
    async def has_digit(self, task: SumData, trace: vf.Trace) -> float:
        return 1.0 if re.search(r"\d", trace.last_reply) else 0.0


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 8


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            a, b = 2 + i, 3
            data = SumData(id=f"sum-{i}", prompt=f"What is {a} + {b}?", system_prompt="Answer briefly.",
                           a=a, b=b, answer=a + b)  # fmt: skip
            yield SumTask(data, self.config.task)


class CheckTwiceConfig(vf.HarnessConfig):
    id: str = "sum-check"


class CheckTwiceHarness(vf.Harness[CheckTwiceConfig]):
    """Asks the model, then asks it to check its answer: two calls, the second extending the first."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kw) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        async with httpx.AsyncClient(timeout=120) as client:
            for _ in range(2):
                reply = await client.post(
                    f"{endpoint}/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                    json={"model": ctx.model, "messages": messages},
                )  # fmt: skip
                if reply.status_code != 200:
                    return vf.ProgramResult(exit_code=1, stdout="", stderr=reply.text)
                content = reply.json()["choices"][0]["message"].get("content") or ""
                messages += [{"role": "assistant", "content": content},
                             {"role": "user", "content": "Check it, and reply with the number only."}]  # fmt: skip
        return vf.ProgramResult(exit_code=0, stdout=content, stderr="")


__all__ = ["SumTaskset", "CheckTwiceHarness"]
