"""A small verifiers (0.4.0, ``verifiers.v1``) taskset and env of the tests: guess a number with "higher" /
"lower" feedback over several turns. Tasks carry the secret as ``answer``; the rubric is two weighted rewards
(``correct``, weight 1; ``brevity``, weight 0.5) and a metric; a ``@vf.stop`` ends the exchange once the number
was said; the env's ``run`` gives the feedback as user turns and records a reward of its own (``turns_bonus``)."""

from __future__ import annotations

import re

import verifiers.v1 as vf

__all__ = ["GuessTaskset", "GuessEnv"]


class GuessData(vf.TaskData):
    answer: str = ""


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(_last_number(trace.last_reply) == self.data.answer)

    @vf.reward(weight=0.5)
    async def brevity(self, trace: vf.Trace) -> float:
        return 1.0 / max(1, len(trace.last_reply.split()))

    @vf.metric
    async def replies(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))

    @vf.stop
    async def found(self, trace: vf.Trace) -> bool:
        return _last_number(trace.last_reply) == self.data.answer


class GuessConfig(vf.TasksetConfig):
    low: int = 1
    high: int = 9


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self):
        for secret in range(self.config.low, self.config.high + 1):
            yield GuessTask(GuessData(prompt=f"Guess my number from {self.config.low} to {self.config.high}.",
                                      system_prompt="Reply with one number.", answer=str(secret)),
                            self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as it:
            segment = await it.turn()
            while not segment.terminated:
                said = _last_number(segment.last_reply)
                if said is None:
                    segment = await it.turn("Reply with one number.")
                else:
                    segment = await it.turn("higher" if int(said) < int(task.data.answer) else "lower")
        it.trace.record_reward("turns_bonus", 1.0 / len(it.trace.assistant_messages), 0.25)


def _last_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d+", text or "")
    return numbers[-1] if numbers else None
