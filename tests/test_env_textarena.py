"""textarena games (megarl/environments/textarena.py) against textarena itself: TicTacToe played by a scripted
policy against the first-move opponent in megarl's episode loop; the episode's reward is the reward textarena
gives the same moves played on the library directly, and win / draw / loss are logged."""

from __future__ import annotations

import pytest

from megarl.agents.env import EnvError, load_environment
from megarl.agents.episode import ChatRenderer
from megarl.agents.parsers import load_parser
from megarl.agents.rollout import EpisodeSettings, run_episodes
from megarl.rollout.base import SamplingConfig
from tests.agent_fixtures import ScriptedEngine, bpe_tokenizer

ta = pytest.importorskip("textarena")


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


def _play(tok, moves, **kwargs):
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    engine = ScriptedEngine(lambda p: ids(moves[tok.decode(p).count("<|im_start|>assistant") - 1])
                            + [tok.eos_token_id], [tok.eos_token_id])
    renderer = ChatRenderer(tok, [], load_parser("auto", tok.chat_template))
    factory = load_environment("textarena", {"game": "TicTacToe-v0", "opponent": "first_move", **kwargs})
    out = run_episodes(engine, renderer, factory, [{}], [[{"role": "user", "content": "play"}]],
                       SamplingConfig(n=1, seed=1), EpisodeSettings(max_turns=9, max_turn_tokens=16))
    return out


def _library_reward(policy_moves, player=0):
    """The same game on textarena directly: the policy's moves, the opponent the first available cell."""
    env = ta.make("TicTacToe-v0-raw")
    env.reset(num_players=2, seed=0)
    moves = iter(policy_moves)
    done = False
    while not done:
        current, _ = env.get_observation()
        board = env.state.game_state["board"]
        free = [f"[{r * 3 + c}]" for r in range(3) for c in range(3) if board[r][c] == ""]
        done, _ = env.step(next(moves) if current == player else free[0])
    rewards, _ = env.close()
    return rewards[player]


@pytest.mark.parametrize("moves,outcome", [(["[4]", "[2]", "[6]"], "win"), (["[8]", "[7]", "[5]"], "loss")])
def test_game_reward_is_textaranas_and_the_outcome_is_logged(tok, moves, outcome):
    out = _play(tok, moves)
    (e,) = out.episodes
    assert e.end == "done" and e.turns == 3
    assert e.reward == _library_reward(moves) == {"win": 1, "loss": -1}[outcome]
    m = out.metrics()
    assert m[f"game/{outcome}"] == 1.0 and m["game/draw"] == 0.0 and m["game/unfinished"] == 0.0
    first = e.messages[0]["content"]
    assert "Tic Tac Toe" in first and "Available Moves" in first  # the game's own prompt and board
    assert "placed their symbol (X) in cell 0" in e.messages[2]["content"]  # the opponent's move, observed


def test_a_game_cut_by_the_turn_limit_scores_zero_and_bad_settings_are_refused(tok):
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    engine = ScriptedEngine(lambda p: ids("[4]" if "assistant" not in tok.decode(p)[-30:] else "[2]")
                            + [tok.eos_token_id], [tok.eos_token_id])
    renderer = ChatRenderer(tok, [], load_parser("auto", tok.chat_template))
    factory = load_environment("textarena", {"game": "TicTacToe-v0", "opponent": "first_move"})
    out = run_episodes(engine, renderer, factory, [{}], [[{"role": "user", "content": "play"}]],
                       SamplingConfig(n=1, seed=1), EpisodeSettings(max_turns=1, max_turn_tokens=16))
    (e,) = out.episodes
    assert e.end == "max_turns" and e.reward == 0.0 and out.metrics()["game/unfinished"] == 1.0
    with pytest.raises(EnvError, match=r"env_kwargs.game: textarena has no game 'TicTacToe-v9'; did you mean"):
        load_environment("textarena", {"game": "TicTacToe-v9"})
    with pytest.raises(EnvError, match=r"env_kwargs.player: 2 is not a player of TicTacToe-v0 with 2 players"):
        load_environment("textarena", {"game": "TicTacToe-v0", "player": 2})
