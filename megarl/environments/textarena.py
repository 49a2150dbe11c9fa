"""textarena games (PyPI ``textarena==0.7.4``) as multi-turn environments: the policy plays one side, a fixed or
scripted opponent the others (``rollout.multi_turn.env: textarena``)::

    rollout:
      multi_turn:
        enabled: true
        env: textarena
        env_kwargs: {game: TicTacToe-v0, player: 0, opponent: random_move}
        max_turns: 9

Each episode makes the game (``ta.make(game + "-raw", **game_kwargs)``: the raw observations, each message once)
and resets it with a seed drawn from the episode's ``self.rng``; the opponents move (``opponent``) until it is
the policy's turn; the policy's reply is the game action (textarena reads the bracketed move, ``[4]``); the
observation messages since the policy's last move (the other players' moves, the board) are the next user
message. When the game is done its reward for the policy (``env.close()``'s rewards; textarena's 1 / 0 / -1
for win / draw / loss in two-player games) is the episode's reward, and ``game/win``, ``game/draw``,
``game/loss`` (the reward above, equal to or below the best other player's; one-player games: > 0, 0, < 0) and
``game/invalid`` (the game ended on the policy's invalid move) are logged as rates over the step's episodes. An
episode cut by megarl's turn or token budgets before the game ended scores 0 (``game/unfinished``).

Opponents: ``random_move`` (a move drawn from the bracketed moves the observation offers, e.g. TicTacToe's
"Available Moves: '[0]', '[4]'"; "[0]" where none are offered), ``first_move`` (the first one offered), or a
dotted path to ``fn(observation: str, rng: random.Random) -> str`` (a scripted opponent).
"""

from __future__ import annotations

import random
import re
from typing import Any, Callable, Mapping

from megarl.agents.env import AssistantTurn, EnvError, Environment, Message, StepResult
from megarl.algos.registry import Registry
from megarl.environments import import_package

PACKAGE = "textarena==0.7.4"
FIELD = "rollout.multi_turn.env_kwargs"
MOVE = re.compile(r"'(\[[^\]]+\])'")  # a bracketed move the observation offers, quoted: '[4]'

OPPONENTS: Registry[Callable[[str, random.Random], str]] = Registry("textarena opponent", "OPPONENTS.register")


@OPPONENTS.register("random_move")
def random_move(observation: str, rng: random.Random) -> str:
    """A move drawn from those the observation offers last ("[0]" where it offers none)."""
    moves = _offered(observation)
    return rng.choice(moves) if moves else "[0]"


@OPPONENTS.register("first_move")
def first_move(observation: str, rng: random.Random) -> str:
    """The first move the observation offers last ("[0]" where it offers none)."""
    moves = _offered(observation)
    return moves[0] if moves else "[0]"


def _offered(observation: str) -> list[str]:
    lines = [line for line in observation.splitlines() if MOVE.search(line)]
    return MOVE.findall(lines[-1]) if lines else []


def _ta():
    return import_package("textarena", PACKAGE, "rollout.multi_turn.env", EnvError)


class TextArenaEnvironment(Environment):
    """One game of textarena per episode (module docstring).

    Args:
        game: a textarena environment id ("TicTacToe-v0", "GuessTheNumber-v0", ...).
        player: the policy's player id.
        num_players: players in the game (default: 2, or 1 for ids textarena registers for one player only).
        opponent: "random_move", "first_move" or a dotted path (module docstring).
        game_kwargs: keyword arguments of ``ta.make``.

    Raises:
        EnvError: textarena missing, an unknown game (close ids listed), a player id out of range, an unknown
            opponent, or a game that does not reset with these settings.
    """

    def __init__(self, game: str, player: int = 0, num_players: int | None = None, opponent: str = "random_move",
                 game_kwargs: Mapping[str, Any] | None = None):
        ta = _ta()
        from textarena.envs.registration import ENV_REGISTRY

        if game not in ENV_REGISTRY:
            import difflib

            close = difflib.get_close_matches(str(game), [k for k in ENV_REGISTRY if not k.endswith("-raw")], n=5)
            raise EnvError(f"{FIELD}.game: textarena has no game {game!r}"
                           + (f"; did you mean one of {close}?" if close else ""))
        self.game, self.player, self.game_kwargs = game, int(player), dict(game_kwargs or {})
        self.opponent = OPPONENTS.find(opponent, EnvError)
        self.metrics: dict[str, float] = {}
        self.env, self.done = None, False
        if num_players is None:  # the fewest players the game takes: 1 where it resets for one
            num_players = 1 if _resets(ta, self._id(), 1, self.game_kwargs) else 2
        self.num_players = int(num_players)
        if not 0 <= self.player < self.num_players:
            raise EnvError(f"{FIELD}.player: {player} is not a player of {game} with {self.num_players} players "
                           f"(0 .. {self.num_players - 1})")
        if not _resets(ta, self._id(), self.num_players, self.game_kwargs):
            raise EnvError(f"{FIELD}: textarena's {game} does not reset for {self.num_players} players with "
                           f"game_kwargs {self.game_kwargs}; set num_players or game_kwargs")

    def _id(self) -> str:
        from textarena.envs.registration import ENV_REGISTRY

        return self.game + "-raw" if self.game + "-raw" in ENV_REGISTRY else self.game

    def reset(self, row: Mapping[str, Any], prompt: list[Message]) -> list[Message]:
        ta = _ta()
        self.env = ta.make(self._id(), **self.game_kwargs)
        self.env.reset(num_players=self.num_players, seed=self.rng.randrange(2**31))
        observation = self._advance()
        if self.done:
            raise EnvError(f"textarena's {self.game} ended before player {self.player}'s first move")
        system = [m for m in prompt[:1] if m.get("role") == "system"]
        return system + [{"role": "user", "content": observation}]

    def step(self, turn: AssistantTurn) -> StepResult:
        self.done, _ = self.env.step(turn.text)
        observation = self._advance()
        if self.done:
            return StepResult(reward=self._outcome(), done=True)
        return StepResult([{"role": "user", "content": observation}])

    def close(self, end: str) -> float | None:
        if self.done:
            return None
        self.metrics = {"game/win": 0.0, "game/draw": 0.0, "game/loss": 0.0, "game/invalid": 0.0,
                        "game/unfinished": 1.0}
        return 0.0

    def _advance(self) -> str:
        """The opponents move until it is the policy's turn or the game is done; returns the policy's
        observation: the messages since its last move, one a line."""
        while not self.done:
            player, observation = self.env.get_observation()
            text = "\n\n".join(str(m[1]) for m in observation if m[0] != player) if isinstance(observation, list) \
                else str(observation)
            if player == self.player:
                return text
            self.done, _ = self.env.step(self.opponent(text, self.rng))
        return ""

    def _outcome(self) -> float:
        rewards, info = self.env.close()
        mine = float(rewards.get(self.player, 0.0))
        others = [float(r) for p, r in rewards.items() if p != self.player]
        best = max(others) if others else 0.0
        self.metrics = {"game/win": float(mine > best), "game/draw": float(mine == best),
                        "game/loss": float(mine < best), "game/unfinished": 0.0,
                        "game/invalid": float(bool(info.get(self.player, {}).get("invalid_move")))}
        return mine


def _resets(ta, game_id: str, num_players: int, kwargs: Mapping[str, Any]) -> bool:
    try:
        ta.make(game_id, **kwargs).reset(num_players=num_players, seed=0)
        return True
    except Exception:  # noqa: BLE001 (textarena asserts or raises on a player count a game does not take)
        return False
