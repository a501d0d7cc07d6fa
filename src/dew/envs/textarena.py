"""TextArena games as in-process multi-turn environments, the agent against the game engine.

`TextArena.parse("Wordle-v0")` names a game of the optional `textarena` package
(`pip install 'dew[verifiers]'`) and its options (the game's own keyword arguments, e.g.
`Wordle-v0,word_length=4`). Each task is one seeded game: its index and the seed draw the secret
word (or the opponent's moves), so a task replays alike. The agent is player 0: it sees what
the engine tells player 0 (the rules first, then each turn's feedback and board), and its
decoded reply is its move, exactly as written (the game reads its bracketed token). In a
two-player game the opponent is fixed: a seeded random legal move (TicTacToe-v0's "Available
Moves"), played at once after each of the agent's moves. With `self_play=true`
(`textarena:TicTacToe-v0,self_play=true`; ConnectFour-v0 is played only so) the policy plays
both players instead: each player is
a seat (`player0`, `player1`) with a conversation of its own, seeing what the engine tells that
player, and trains on its own reward against the same player of its group (`Score.seats`); the
session's reward is their sum (0 for a decided game of TicTacToe).

The reward is the game's own for player 0 (TextArena's: 1 for a win, -1 for a loss, 0 for a
draw; a game ended by invalid moves gives what the game gives, Wordle the share of letters
found). verifiers' TextArena taskset is not used: it downloads nltk data each time it loads.
textarena's Wordle needs nltk's `words` corpus and `averaged_perceptron_tagger_eng` tagger,
which it downloads when missing: dew refuses the game instead, naming the data to install
(`python -m nltk.downloader words averaged_perceptron_tagger_eng`), and builds the game inside
`dew.envs._offline.no_downloads` (nltk's downloader, which textarena calls even for data in
place, answers from the data without reaching the network).

An invalid move is the game's to judge, by its rules: textarena lets a player retry one invalid
move before each valid one, and ends the game, as that player's loss, at a second in a row.
dew's move limit (`TextArena.max_turns`) is the longest game those rules allow (twice the
valid moves a player can make: 12 for a Wordle of 6 guesses, `num_guesses` included), so
only a smaller `max_turns` cuts a game.

Outcomes (through `EnvironmentSource`): COMPLETED when the game is over, scored with the game's
reward; TRUNCATED with `turns` when `max_turns` moves pass first, or `context` when the
conversation outgrows `max_context`: the game is not over, and dew scores it as lost (0 in
Wordle, -1 in TicTacToe), so running out of turns never pays better than losing; AGENT_ERROR
when the game raises on a move (rather than refusing it), the error naming the game and its
exception, scored as a game dew cut; INFRA_ERROR when the game raises elsewhere (building,
resetting, the fixed opponent's move).
"""

from __future__ import annotations

import copy
import importlib.metadata
import random
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np

from dew._checks import int_at_least
from dew.data import ArrayDataset, Batch, Task
from dew.envs._offline import no_downloads
from dew.envs._releases import check_release
from dew.envs.environment import (
    EnvironmentSource,
    Episode,
    MalformedAction,
    Observation,
    Sampling,
    Score,
    Seated,
    describe,
)
from dew.envs.tasks import task_id
from dew.envs.verifiers import parse_spec
from dew.serve.tokenizer import BYTES, Tokenizer

PREFIX = "textarena:"
"""How `dew train --env` names a TextArena game: `textarena:GAME[,key=value...]`."""

# textarena seeds its games from the process-wide `random`: seeding and resetting hold this.
_RANDOM = threading.Lock()
_AVAILABLE = re.compile(r"'\[(\d+)\]'")


def _available_move(observation: str, rng: np.random.Generator) -> str:
    """A random move among the board's "Available Moves" ('[4]', ...), the latest listed."""
    board = observation.rsplit("Available Moves:", 1)[-1]
    moves = _AVAILABLE.findall(board)
    return f"[{moves[rng.integers(len(moves))]}]" if moves else "[0]"


def _guesses(env: Any) -> int:
    return env.num_guesses


def _discs(env: Any) -> int:
    return -(-env.num_rows * env.num_cols // 2)


@attrs.frozen
class Game:
    """What dew knows of a supported game.

    Args:
        players: 1, or 2 for a game against the fixed opponent.
        moves: the most valid moves player 0 makes in a game built as the given one (its
            options, such as Wordle's `num_guesses`, set it): with the invalid move textarena
            lets a player retry before each (`error_allowance=1`), a game takes its player at
            most twice as many moves, and dew's move limit lets it end by its own rules.
        max_context: most tokens of a game's conversation (prompt and replies).
        nltk: the nltk data (resource paths) the game reads.
        opponent: the second player's move from its observation and a seeded generator; None
            for a game of two players that dew plays only against itself (`self_play`).
        cut: the reward of a game dew cuts (too many moves, too long a conversation): the
            game's reward for a loss, so that running out of turns never beats losing.
    """

    players: int
    moves: Callable[[Any], int]
    max_context: int
    nltk: tuple[str, ...] = ()
    opponent: Callable[[str, np.random.Generator], str] | None = None
    cut: float = 0.0


_WORDLE_DATA = ("corpora/words", "taggers/averaged_perceptron_tagger_eng/")
GAMES: Mapping[str, Game] = {
    # Wordle gives a lost game 0 (and a game lost to invalid moves the share of letters found).
    "Wordle-v0": Game(1, _guesses, 2048, _WORDLE_DATA),
    "Wordle-v0-hardcore": Game(1, _guesses, 2048, _WORDLE_DATA),
    "Wordle-v0-long": Game(1, _guesses, 3072, _WORDLE_DATA),
    # Player 0 moves first: 5 of the 9 cells.
    "TicTacToe-v0": Game(2, lambda env: 5, 2048, opponent=_available_move, cut=-1.0),
    # Self-play only: 21 discs each fill the board. A player's conversation grows about 390
    # bytes a move, 8.4 kB a full game: over 4096 tokens of the byte tokenizer.
    "ConnectFour-v0": Game(2, _discs, 4096, cut=-1.0),
}
"""The games dew plays, by TextArena id."""


def _nltk_package(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _check_data(name: str, game: Game) -> None:
    """Raises: ValueError naming the nltk data the game needs and does not find."""
    if not game.nltk:
        return
    import nltk

    missing = []
    for path in game.nltk:
        try:
            nltk.data.find(path)
        except LookupError:
            missing.append(_nltk_package(path))
    if missing:
        raise ValueError(
            f"textarena {name} needs nltk data it would download: {', '.join(missing)} (not "
            f"in nltk.data.path {nltk.data.path}); install it with `python -m nltk.downloader "
            f"{' '.join(missing)}`, or point NLTK_DATA at a folder holding it"
        )


def _message_text(messages, player: int = 0) -> str:
    """A player's new messages as one user turn. Moves echoed back are left out when they are
    the player's own (or sent by the game, -1, in a one-player game such as Wordle) and named
    when they are the other player's."""
    import textarena as ta

    texts = [
        f"Player {sender}: {text}" if kind == ta.ObservationType.PLAYER_ACTION else str(text)
        for sender, text, kind in messages
        if not (kind == ta.ObservationType.PLAYER_ACTION and sender in (player, -1))
    ]
    return "\n\n".join(texts)


class TextArenaGame:
    """One episode of a TextArena game as a dew `Environment` (reset/step): the agent player 0
    against the game's fixed opponent, or, in self-play, every player as a seat of its own.

    Args:
        template: the game as built once (building Wordle tags its word list and reads two
            dictionaries). Each episode plays a shallow copy: `reset` gives the copy a state of
            its own, and these games only read the rest (a deep copy of Wordle's dictionaries
            took 1.6 s an episode).
        game: what dew knows of it.
        seed: the run's seed; a task's game is a function of it and the task's id.
        self_play: the policy plays every player, each a seat (`Seated`, "player0", ...).
    """

    def __init__(self, template: Any, game: Game, seed: int, *, self_play: bool = False):
        self.template = template
        self.game = game
        self.seed = seed
        self.self_play = self_play
        self.env: Any = None
        self.rng: np.random.Generator | None = None

    def reset(self, task: Task) -> Observation | Seated:
        """Start `task`'s game (seeded by the run's seed and its id); return the rules and
        board player 0 sees first, after the opponent's moves when it starts (in self-play,
        what the player to move sees, seated)."""
        index = task_id(task)
        seed = int(np.random.SeedSequence([self.seed, index]).generate_state(1)[0])
        self.env = copy.copy(self.template)
        self.rng = np.random.default_rng(seed)
        with _RANDOM:
            random.seed(seed)
            self.env.reset(num_players=self.game.players, seed=seed)
        if self.self_play:
            return self._seated()
        self._opponent_moves()
        return _message_text(self.env.get_observation()[1])

    def step(self, action: str) -> tuple[Observation | Seated | None, bool]:
        """Play the agent's move, then the opponent's; return what player 0 sees next (in
        self-play, the move of the player to move, and what the next one sees, seated) and
        whether the game is over.

        Raises:
            MalformedAction: naming the game and its exception when the game raises on the
                move (a cell number too long for `int`): the policy's move, AGENT_ERROR, scored
                as the game dew cut (`Game.cut`); a move the game refuses is its own invalid
                move, played by its rules.
        """
        try:
            done, _ = self.env.step(action)
        except Exception as error:
            game = type(self.template).__name__
            raise MalformedAction(
                f"textarena {game} raised on the move of player "
                f"{self.env.state.current_player_id}: {describe(error)}"
            ) from error
        if not self.self_play:
            done = done or self._opponent_moves()
        if done:
            return None, True
        if self.self_play:
            return self._seated(), False
        player, messages = self.env.get_observation()
        return _message_text(messages), False

    def _seated(self) -> Seated:
        """What the player to move sees, as its seat's observation."""
        player, messages = self.env.get_observation()
        return Seated(f"player{player}", _message_text(messages, player))

    def _opponent_moves(self) -> bool:
        """Play the opponent until it is the agent's turn; return whether the game is over."""
        while not self.env.state.done and self.env.state.current_player_id != 0:
            _, messages = self.env.get_observation()
            text = "\n".join(str(text) for _, text, _ in messages)
            done, _ = self.env.step(self.game.opponent(text, self.rng))
            if done:
                return True
        return bool(self.env.state.done)

    @property
    def reward(self) -> float | None:
        """Player 0's reward in a finished game; None before it ends."""
        rewards = self.env.state.rewards if self.env is not None else None
        return None if not rewards else float(rewards[0])

    def player_rewards(self) -> dict[str, float]:
        """Each player's reward by its seat ("player0", ...): a game dew cut (too many moves,
        too long a conversation) is each player's loss (`Game.cut`)."""
        rewards = self.env.state.rewards if self.env is not None else None
        return {
            f"player{player}": self.game.cut if not rewards else float(rewards[player])
            for player in range(self.game.players)
        }


def verify(env: TextArenaGame, episode: Episode) -> Score:
    """The game's reward for player 0 (a game dew cut: its loss, `Game.cut`), and whether it
    won, moved invalidly, and its moves. In self-play, each player's reward as its seat's,
    their sum as the episode's, and whether each won."""
    infos = env.env.state.game_info
    common = {
        "invalid_move": float(any(info.get("invalid_move") for info in infos.values())),
        "moves": float(len(episode.actions)),
    }
    if env.self_play:
        seats = env.player_rewards()
        wins = {f"{seat}/win": float(reward > 0) for seat, reward in seats.items()}
        return Score(sum(seats.values()), {**wins, **common}, seats=seats)
    reward = env.reward
    return Score(
        env.game.cut if reward is None else reward,
        {"win": float(reward is not None and reward > 0), **common},
    )


def _options(instance, attribute, value):
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise ValueError(f"{attribute.name} must be a mapping of str keys, got {value!r}")


@attrs.frozen
class TextArena:
    """A TextArena game's tasks, their dataset and their source.

    Args:
        name: the game's TextArena id, one of `GAMES`.
        options: the game's keyword arguments (e.g. `word_length` for Wordle).
        seed: draws each task's game with its id.
        self_play: in a game of two players, the policy plays both, each player a seat that
            trains on its own reward; False plays player 0 against the fixed opponent.

    Raises:
        ImportError: naming the extra to install when textarena is missing.
        ValueError: naming the game when dew does not play it, the option it refuses or with
            which it cannot start a game (its first game's reset raises), the nltk data it
            needs and does not find, or self-play in a game of one player.
    """

    name: str = attrs.field(validator=attrs.validators.instance_of(str))
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=dict, validator=_options)
    seed: int = attrs.field(default=0, kw_only=True, validator=int_at_least(0))
    self_play: bool = attrs.field(
        default=False, kw_only=True, validator=attrs.validators.instance_of(bool)
    )
    _template: Any = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self):
        try:
            check_release("textarena")
        except importlib.metadata.PackageNotFoundError:
            raise ImportError(
                "TextArena games need the textarena package: pip install 'dew[verifiers]'"
            ) from None
        import textarena as ta

        if self.name not in GAMES:
            raise ValueError(f"dew plays TextArena games {', '.join(GAMES)}; not {self.name!r}")
        game = GAMES[self.name]
        if self.self_play and game.players < 2:
            raise ValueError(f"textarena {self.name} has one player: self_play needs two")
        if game.players > 1 and game.opponent is None and not self.self_play:
            raise ValueError(
                f"textarena {self.name} has no fixed opponent in dew: play it against itself "
                "with self_play=true"
            )
        _check_data(self.name, game)
        try:
            with no_downloads():
                # The raw game: dew writes the conversation itself, one turn per message.
                template = ta.make(f"{self.name}-raw", **self.options)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"textarena {self.name} refuses options {dict(self.options)}: {error}"
            ) from error
        object.__setattr__(self, "_template", template)
        try:
            # Options that leave no game to play (a Wordle of `word_length=30` has no word to
            # draw) would fail every rollout's reset: refuse them once, here.
            self.environment().reset(Task("0"))
        except Exception as error:
            raise ValueError(
                f"textarena {self.name} with options {dict(self.options)} cannot start a game: "
                f"{describe(error)}"
            ) from error
        try:
            # An option of the wrong type that the game keeps without using it to start
            # (Wordle's num_guesses="abc") counts its moves in something other than a number.
            max_turns = self.max_turns
            if not isinstance(max_turns, int):
                raise TypeError(f"its moves count as {max_turns!r}, not a number")
        except TypeError as error:
            raise ValueError(
                f"textarena {self.name} refuses options {dict(self.options)}: {error}"
            ) from None
        if max_turns < 1:
            # A board of no cells, or a Wordle of no guesses, starts but leaves no move.
            raise ValueError(
                f"textarena {self.name} with options {dict(self.options)} leaves the player no "
                "move to make"
            )

    @classmethod
    def parse(cls, spec: str, *, seed: int = 0) -> TextArena:
        """The game `spec` names: `GAME[,key=value...]`, with or without `textarena:`; the
        key `self_play` (true or false) is dew's, the others the game's."""
        name, options = parse_spec(spec, PREFIX)
        self_play = options.pop("self_play", False)
        if not isinstance(self_play, bool):
            raise ValueError(f"environment {spec!r}: self_play must be true or false")
        return cls(name, options, seed=seed, self_play=self_play)

    @property
    def game(self) -> Game:
        """What dew knows of this game (`GAMES`)."""
        return GAMES[self.name]

    @property
    def max_turns(self) -> int:
        """The most moves a game takes from the policy (every player's, in self-play): each
        valid move a player can make (`Game.moves`), each after the one invalid move textarena
        lets a player retry. `source`'s default limit: dew cuts no game its rules play on."""
        players = self.game.players if self.self_play else 1
        return 2 * self.game.moves(self._template) * players

    def environment(self) -> TextArenaGame:
        """A fresh episode's environment."""
        return TextArenaGame(self._template, self.game, self.seed, self_play=self.self_play)

    def tasks(self, batch: Batch) -> list[Task]:
        """One task per `task_id` row, named by its id."""
        return [Task(str(int(index))) for index in np.asarray(batch["task_id"])]

    def dataset(
        self, rows: int, batch_size: int, *, shuffle_seed: int | None = 0, epochs: int = 1
    ) -> ArrayDataset:
        """Task ids 0 .. rows-1 in batches of `batch_size`, shuffled per epoch."""
        return ArrayDataset(
            {"task_id": np.arange(rows, dtype=np.int64)},
            batch_size,
            shuffle_seed=shuffle_seed,
            epochs=epochs,
        )

    def source(
        self,
        engine: Any,
        *,
        max_tokens: int,
        max_turns: int | None = None,
        max_context: int | None = None,
        sampling: Sampling | None = None,
        tokenizer: Tokenizer = BYTES,
    ) -> EnvironmentSource:
        """An `EnvironmentSource` of this game on `engine`: a reply of up to `max_tokens` is a
        move even without a stop token (the game reads its bracketed token). `max_turns`
        counts every seat's moves: by default the longest game (`TextArena.max_turns`)."""
        return EnvironmentSource(
            engine,
            self.environment,
            verify,
            max_turns=self.max_turns if max_turns is None else max_turns,
            max_tokens=max_tokens,
            max_context=self.game.max_context if max_context is None else max_context,
            require_stop=False,
            sampling=Sampling() if sampling is None else sampling,
            tokenizer=tokenizer,
        )
