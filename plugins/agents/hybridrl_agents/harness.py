"""The ``harness`` environment: runs an unmodified agent per task against the agent gateway.

Each episode runs the configured ``command`` (a process) or ``callable`` (a Python function) with
``OPENAI_BASE_URL`` pointing at its episode and ``OPENAI_API_KEY`` holding the gateway's token; the
episode's trajectory is what its calls sampled (:mod:`hybridrl_agents.episodes`). An episode whose
harness fails, hangs past ``timeout_s`` or makes no call is lost: it stays in its group with no
tokens (nothing of it trains; its reward is what the reward functions give an empty answer),
counted in ``agent/lost_mean`` and named on stderr, and the run goes on.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from hybridrl.agents import Trajectory
from hybridrl.components import INPUT_PATH, Environment, Options
from hybridrl.plugins import load_object
from hybridrl_agents.gateway import Gateway
from hybridrl_agents.store import STORE, EpisodeStore, episode_key

OUTPUT_TAIL = 65536  # bytes of a command's output kept for rewards and the log
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class HarnessOptions(Options):
    command: str | None = Field(
        None, description="The agent as a command line, run once per episode (no shell; split like a shell would)."
    )
    callable: str | None = Field(
        None, description="The agent as a Python function 'module:function' or 'file.py:function', called with a Task."
    )
    concurrency: int = Field(8, gt=0, description="Episodes of a rollout call that run at once (streamed: of a group).")
    timeout_s: float = Field(300.0, gt=0, description="Seconds an episode may run; past them it is stopped and lost.")
    reward_wait_s: float = Field(
        0.0, ge=0, description="Seconds to wait, after the harness ends, for a reward posted to the episode."
    )
    reward_deadline_s: float = Field(
        0.0,
        ge=0,
        description="Late rewards: seconds a finished group may wait, across steps, for rewards posted to its "
        "episodes; it trains at the first step after they are in (0: rewards come within reward_wait_s).",
    )
    port: int = Field(
        0, ge=0, le=65535, description="The gateway's port on 127.0.0.1 (0: any free one); fix it for late rewards."
    )
    answer: Literal["reply", "returned", "stdout"] = Field(
        "reply",
        description="The episode's final answer for rewards: the last reply's text, what the callable returned, "
        "or the command's standard output.",
    )
    workdir: str | None = Field(
        None, description="A folder copied into each episode's working folder.", json_schema_extra=INPUT_PATH
    )
    env: dict[str, str] = Field(default_factory=dict, description="More environment variables for the command.")
    max_calls: int = Field(64, gt=0, description="Most calls of one episode; more get 429.")
    branches: Literal["all", "last"] = Field(
        "all",
        description="What of an episode that forked trains: 'all' its branches (each a row of its own, with the "
        "episode's reward), 'last' the last call's branch only.",
    )
    batch_requests: int = Field(64, gt=0, description="Most requests answered by one engine call.")
    batch_wait_s: float = Field(
        0.05,
        ge=0,
        description="Seconds an engine call waits for the running episodes' next request while they keep coming (20x "
        "in all); it goes at once when each running episode has a request in, or batch_requests are in.",
    )
    max_request_bytes: int = Field(4 << 20, gt=0, description="Largest request body the gateway reads.")
    keep_episodes: int = Field(10_000, gt=0, description="Finished episodes kept for an exact resume.")

    @model_validator(mode="after")
    def _one_agent(self):
        if (self.command is None) == (self.callable is None):
            raise ValueError("set one of 'command' (a command line) or 'callable' ('module:function')")
        if self.answer == "returned" and self.callable is None or self.answer == "stdout" and self.command is None:
            raise ValueError(f"answer: {self.answer} needs {'callable' if self.answer == 'returned' else 'command'}")
        return self


@dataclass
class Task:
    """What a callable harness gets: the task, and where its agent calls."""

    prompt: str  # the task's last user message
    messages: list[dict]  # the task's chat messages, as the data section builds them
    row: dict  # the prompt source's row
    base_url: str  # OPENAI_BASE_URL of its episode
    api_key: str  # OPENAI_API_KEY
    episode_id: str
    reward_url: str  # POST {"reward": x} here for a reward the harness gives
    workdir: Path

    def environ(self) -> dict[str, str]:
        return {
            "OPENAI_BASE_URL": self.base_url,
            "OPENAI_API_KEY": self.api_key,
            "HYBRIDRL_EPISODE_ID": self.episode_id,
            "HYBRIDRL_REWARD_URL": self.reward_url,
            "HYBRIDRL_PROMPT": self.prompt,
            "HYBRIDRL_TASK": json.dumps(self.row, default=str)[:100_000],
        }


def command_line(command: str) -> list[str]:
    """The command's words, run in each episode's own folder: ``python``/``python3`` is the
    interpreter that runs hybridrl (its packages, openai among them), and a word naming a file or
    folder relative to where the run started is made absolute."""
    argv = shlex.split(command)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return [str(Path(w).resolve()) if not os.path.isabs(w) and os.path.exists(w) else w for w in argv]


def death_signal():
    """A function for the harness's process to run before its program (Linux): the kernel then
    kills it when the thread that started it ends, so a trainer killed with SIGKILL leaves no agent
    behind. ``libc.prctl`` is looked up here, in the trainer: after a fork only the call is made."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    args = [ctypes.c_ulong(v) for v in (PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)]
    return lambda: prctl(*args)


class HarnessEnvironment(Environment):
    """An unmodified agent per episode, its calls answered and recorded by the gateway."""

    Options = HarnessOptions
    drives = True

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.gateway: Gateway | None = None
        self.agent = load_object(options.callable) if options.callable else None
        self.argv = command_line(options.command) if options.command else None
        self.succeeded = False  # an episode of this run has ended well: a failing one is the harness's
        self.death_signal = death_signal()
        self.store = EpisodeStore(Path(ctx.run_dir) / STORE, options.keep_episodes)
        # working folder -> made by a training call: kept until its rewards are in (release), else until the
        # next call that is not a training call (an evaluation's)
        self.folders: dict[str, bool] = {}
        self.lock = threading.Lock()  # the folders; held groups handed to one call alone
        self.name = options.command or options.callable

    def rollout(self, rows, messages, sampling, loop, train=False) -> list[Trajectory]:
        """``sampling.n`` episodes per row; with late rewards, a training call's groups are held
        until their rewards are in, and the call is answered with the oldest groups that are."""
        with self.lock:  # one gateway, also for the first calls of streamed groups
            if self.gateway is None:
                name, token = Path(self.ctx.model_path).name, self.store.token()
                self.gateway = Gateway(loop, self.parser, self.options, name, token, self.store.post_reward)
        if not train:
            self._remove_folders(lambda made_by_training, _: not made_by_training)
        n, out, work = sampling.n, {}, []
        late = train and self.options.reward_deadline_s > 0
        groups = [episode_key(self.name, sampling.seed, -1 - i, row) if late else None for i, row in enumerate(rows)]
        for index in range(len(rows) * n):
            key = episode_key(self.name, sampling.seed, index, rows[index // n])
            stored = self.store.get(key)
            if stored is not None:
                out[index] = stored_trajectory(stored)
            else:
                work.append((index, key))
        batcher = self.gateway.batcher
        before = batcher.calls, batcher.rows
        with cf.ThreadPoolExecutor(self.options.concurrency, thread_name_prefix="hybridrl-harness") as pool:
            futures = {pool.submit(self._episode, i, rows[i // n], messages[i // n], sampling, loop, train): (i, key)
                       for i, key in work}  # fmt: skip
            for future in cf.as_completed(futures):
                index, key = futures[future]
                t, episode = future.result()
                with self.gateway.lock:  # acknowledged: a resume trains it, never runs it again
                    t.state["reward"] = episode.reward  # one posted after the harness ended, too
                    t.info["reward_posted"] = int(episode.reward is not None)
                    self.store.put(key, record(t) | {"row": rows[index // n]}, episode.id, groups[index // n])
                    self.gateway.forget(episode)
                out[index] = t
        episodes = [out[i] for i in range(len(rows) * n)]
        calls, prompts = batcher.calls - before[0], batcher.rows - before[1]
        for t in episodes:  # the rollout's engine calls: fewer and fuller is faster (batch_wait_s)
            t.info["engine_calls"], t.info["engine_call_rows"] = calls, prompts / max(calls, 1)
        self.succeeded = self.succeeded or any(t.state["lost"] is None for t in episodes)
        if not self.succeeded:  # nothing has worked yet: the harness, not the policy, is at fault
            raise RuntimeError(
                f"every episode of the run's first rollout was lost; the first: {episodes[0].state['lost']}. "
                f"Check that {self.name!r} runs on its own, with OPENAI_BASE_URL and OPENAI_API_KEY set"
            )
        if not late:
            return episodes
        for group in groups:
            self.store.hold(group, time.time())  # a resumed call keeps the time its group first ended
        return self._hand(str(sampling.seed), len(rows))

    def _hand(self, call: str, most: int) -> list[Trajectory]:
        """The oldest held groups whose rewards are in (or whose deadline passed), at most ``most``:
        those handed to this call before a resume, else the first ready, waiting for one if none is."""
        deadline, said = self.options.reward_deadline_s, False
        while not (handed := self.store.handed(call)):
            with self.lock:  # calls at once (streamed groups) never take the same group
                held, now = self.store.held(), time.time()
                ready = [g for g, ended, missing in held if not missing or now > ended + deadline][:most]
                if ready:
                    self.store.hand(call, ready)
            if not ready and not said:
                wait = min(ended + deadline for _, ended, _ in held) - now
                print(f"agent harness: waiting for posted rewards: none of {len(held)} held groups has all of "
                      f"its rewards (the oldest's deadline is in {wait:.0f} s)", file=sys.stderr)  # fmt: skip
                said = True
            if not ready:
                time.sleep(0.1)
        left, out = len(self.store.held()), []
        for group in handed:
            for key in self.store.members(group):
                stored = self.store.get(key)
                t = stored_trajectory(stored)
                t.row = stored["row"]
                t.info |= {"held_groups": left, "reward_posted": int(t.state["reward"] is not None)}
                out.append(t)
        return out

    def _episode(self, index: int, row: dict, chat: list[dict], sampling, loop, train: bool) -> Trajectory:
        gateway = self.gateway
        episode = gateway.open(index, row, sampling)
        folder = tempfile.mkdtemp(prefix="hybridrl-episode-")
        with self.lock:
            self.folders[folder] = train
        if self.options.workdir:
            shutil.copytree(Path(self.options.workdir).expanduser(), folder, dirs_exist_ok=True)
        prompt = next((m["content"] for m in reversed(chat) if m["role"] == "user"), "")
        task = Task(
            prompt, chat, row, gateway.base_url(episode), gateway.token, episode.id,
            f"{gateway.url}/episodes/{episode.id}/reward", Path(folder),
        )  # fmt: skip
        state: dict[str, Any] = {"id": episode.id, "workdir": folder, "output": "", "returned": None}
        lost = self._run(task, state)
        deadline = time.monotonic() + self.options.reward_wait_s
        while episode.reward is None and not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        gateway.finish(episode)
        if lost is None and episode.final is None:
            lost = "it made no call to the gateway"
        if lost:
            print(f"agent harness: episode {episode.id} lost: {lost} ({self.name})", file=sys.stderr)
        state |= {"reward": episode.reward, "lost": lost, "calls": episode.calls}
        return trajectory(index, episode, state, lost, loop, chat, self.options), episode

    def _run(self, task: Task, state: dict) -> str | None:
        """Run the harness for ``task``; why the episode is lost, or None."""
        if self.agent is not None:
            return self._call(task, state)
        env = os.environ | self.options.env | task.environ()
        log = task.workdir / ".hybridrl-output"
        with open(log, "wb") as output:
            try:
                proc = subprocess.Popen(
                    self.argv, cwd=task.workdir, env=env, stdin=subprocess.DEVNULL, stdout=output,
                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=self.death_signal,
                )  # fmt: skip
            except OSError as e:
                return f"cannot start the command: {e}"
            try:
                code = proc.wait(self.options.timeout_s)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # what it started, too
                proc.wait()
        with open(log, "rb") as f:
            f.seek(max(0, log.stat().st_size - OUTPUT_TAIL))
            state["output"] = f.read().decode(errors="replace")
        log.unlink()
        if code is None:
            return f"it ran longer than timeout_s={self.options.timeout_s:g} s and was stopped"
        last = (state["output"].strip().splitlines() or [""])[-1][:300]
        return f"the command exited with status {code}: {last}" if code else None

    def _call(self, task: Task, state: dict) -> str | None:
        result: dict[str, Any] = {}

        def run():
            try:
                result["value"] = self.agent(task)
            except BaseException as e:  # the agent's failure is the episode's, never the run's
                result["error"] = f"{type(e).__name__}: {e}"

        thread = threading.Thread(target=run, name=f"hybridrl-agent-{task.episode_id}", daemon=True)
        thread.start()
        thread.join(self.options.timeout_s)
        if thread.is_alive():  # it cannot be killed: its episode ends, so its next call fails
            return f"it ran longer than timeout_s={self.options.timeout_s:g} s and was abandoned"
        if "error" in result:
            return f"the callable raised {result['error'][:300]}"
        value = result.get("value")
        state["returned"] = value if isinstance(value, str) else None
        return None

    def release(self, states: list) -> None:
        """The rewards of these episodes are in: their working folders go."""
        mine = {s.get("workdir") for s in states if isinstance(s, dict)}
        self._remove_folders(lambda made_by_training, folder: folder in mine)

    def _remove_folders(self, which=lambda *_: True) -> None:
        with self.lock:
            gone = [f for f, made_by_training in self.folders.items() if which(made_by_training, f)]
            for folder in gone:
                del self.folders[folder]
        for folder in gone:
            shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        if self.gateway is not None:
            self.gateway.close()
        self._remove_folders()
        self.store.close()


def trajectory(index: int, episode, state: dict, lost: str | None, loop, chat: list[dict], options) -> Trajectory:
    """The episode as the batch's row: the last call's trajectory, with its earlier branches
    (``options.branches``), or no tokens when lost."""
    info = Counter(
        calls=episode.calls, forks=episode.forks, tool_calls=episode.tool_calls, lost=int(bool(lost)),
        malformed_tool_calls=episode.malformed, reward_posted=int(episode.reward is not None),
        tool_choice_unmet=episode.unforced,
    )  # fmt: skip
    trained = [] if lost else episode.trained(options.branches == "all")
    info["untrained_tokens"] = episode.untrained_tokens(trained)
    if not trained:
        text = loop.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        prompt = loop.tokenizer(text, add_special_tokens=False)["input_ids"]
        return Trajectory(index, prompt, list(chat), state, finish="abort", info=info, done=True)
    final, earlier = trained[0], trained[1:]
    info["observation_tokens"] = final.sampled.count(0)
    info["trained_branches"] = len(trained)
    last_text = {"reply": final.text, "returned": state["returned"], "stdout": state["output"].strip()}[options.answer]
    branches = [
        {"prompt": t.prompt, "ids": t.ids, "logprobs": t.logprobs, "sampled": t.sampled, "finish": finish(t)}
        for t in earlier
    ]
    return Trajectory(
        index, final.prompt, [*final.messages, final.reply], state, list(final.ids), list(final.logprobs),
        list(final.sampled), turns=episode.calls, last_text=last_text or "", done=True, finish=finish(final),
        info=info, branches=branches,
    )  # fmt: skip


def finish(turn) -> str:
    return "length" if turn.finish == "length" else "stop"


def stored_trajectory(stored: dict) -> Trajectory:
    fields = {k: v for k, v in stored.items() if k != "row"}
    return Trajectory(**fields | {"info": Counter(stored["info"])})


def record(t: Trajectory) -> dict:
    """A trajectory as the store keeps it (the fields of :class:`Trajectory`)."""
    return {
        "index": t.index, "prompt": t.prompt, "messages": t.messages, "state": t.state, "ids": t.ids,
        "logprobs": t.logprobs, "sampled": t.sampled, "turns": t.turns, "last_text": t.last_text,
        "done": t.done, "finish": t.finish, "reward": t.reward, "info": dict(t.info), "branches": t.branches,
    }  # fmt: skip
