"""The offline default model, ``tiny``: a ~0.2M-parameter Llama built locally.

LlamaGym must run end to end (tests, CI, a first ``llamagym train``) on a
machine with no GPU and no access to the Hugging Face Hub. ``tiny`` fills that
role: a randomly initialised Llama-architecture causal LM plus a tokenizer
trained on the spot from a corpus kept in this module. It builds in a couple
of seconds, is cached on disk, and loads through the ordinary
``AutoModelForCausalLM`` / ``AutoTokenizer`` path like any Hub checkpoint.

Tokenizer design:

* Byte-level BPE. Every one of the 256 byte values is in the vocabulary, so any
  Unicode string an environment produces encodes losslessly; there is no
  ``<unk>`` to hide bugs in prompts.
* Digits are split one per token (``Digits(individual_digits=True)`` runs
  before the byte-level step). A model this small cannot memorise the meaning
  of hundreds of merged number tokens, but it can learn ten digit tokens and
  their positions, which is what observations like ``Your sum is 14`` or
  ``Pole angle: -0.031`` need.
* The vocabulary (~1024) is trained on words agents actually read and write
  (Blackjack, CartPole, text adventures, JSON actions), so prompts and answers
  are a few tokens each and the embedding table stays small.
* Chat formatting uses dedicated special tokens (``<|system|>``, ``<|user|>``,
  ``<|assistant|>``, ``<|end|>``) with ``<|end|>`` as eos, so an episode turn
  ends with one well-defined token the sampler can stop on.

Building is deterministic: the same ``seed`` yields byte-identical
``tokenizer.json`` and identical weights.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from llamagym.paths import models_cache_dir, publish_directory, remove_stale_temp_dirs

logger = logging.getLogger(__name__)

# Bump when the corpus, tokenizer settings or architecture change, so caches
# built by an older LlamaGym are not silently reused.
TINY_MODEL_VERSION = 1

PAD_TOKEN = "<|pad|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
END_TOKEN = "<|end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, END_TOKEN)

TARGET_VOCAB_SIZE = 1024

# Written out because the tokenizer's own role tokens are what the model sees.
# Unknown roles are an error rather than silently becoming an unseen token.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('tiny model chat template: unsupported role ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|assistant|>\\n' -}}"
    "{%- endif -%}"
)

MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}

# A marker written last inside the build directory; a target directory without
# it (or with another version or seed in it) is rebuilt.
_BUILD_INFO_FILE = "llamagym_tiny.json"
# Seeding torch's global RNG is process-wide, so two threads building at once
# could interleave their draws; processes are kept apart by the atomic rename.
_build_lock = threading.Lock()


# --------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------

_BASE_TEXT = """\
You are an agent playing a game. Read the observation and choose an action.
Reply with exactly one action and nothing else.
The game is over. You won the game. You lost the game. It is a draw.
Your reward is 1. Your reward is 0. Your reward is -1. The episode ends.
A new episode begins. Take the next step. Think about the best move.
Each turn you see the state of the game and answer with an action.
The agent learns from rewards: good actions get a high reward, bad ones a low reward.
Valid actions are listed below. Choose one of the valid actions.
That is not a valid action. Please answer with a valid action.
You are playing Blackjack. The goal is to get a sum close to 21 without going over.
Your sum is the total of your cards. The dealer shows one card.
If your sum is over 21 you bust and lose. The dealer must hit until 17.
A usable ace counts as 11 without making you bust. Otherwise an ace counts as 1.
Do you want to stick or hit? Say stick to stay, or hit to draw another card.
Stick means you stay with your cards. Hit means you take one more card.
You decide to hit. You decide to stick. You decide to stay.
The dealer draws a card. The dealer busts. The dealer has a higher sum.
Cards: ace, two, three, four, five, six, seven, eight, nine, ten, jack, queen, king.
Suits: hearts, diamonds, clubs, spades. The deck is shuffled. Draw a card from the deck.
You are balancing a pole on a cart. Push the cart LEFT or RIGHT to keep the pole upright.
Cart position, Cart velocity, Pole angle and Pole angular velocity describe the state.
If the pole falls too far or the cart leaves the track, the episode ends.
Move the cart to the left. Move the cart to the right. Push LEFT. Push RIGHT.
The pole is leaning to the left, so push the cart left.
The pole is leaning to the right, so push the cart right.
Answer LEFT or RIGHT. Answer left or right. The answer is LEFT. The answer is RIGHT.
You are in a text adventure. Type a command to act in the world.
Commands: look, inventory, examine, take, drop, open, close, put, eat, go, unlock.
Directions: north, south, east, west, up, down. You can go north, south, east or west.
You are carrying nothing. You are carrying a key and an apple.
You see a door, a key, a chest and a table. There is an exit to the north.
The door is locked. The door is open. The chest is closed. The chest is empty.
You open the door. You unlock the door with the key. You take the key.
You put the apple on the table. You eat the apple. You drop the book.
You examine the map. It shows the way to the kitchen.
Welcome to the kitchen. There is a fridge, a stove, a counter and a table here.
Welcome to the bedroom. There is a bed, a wardrobe and a lamp here.
Welcome to the garden. There is a shed, a gate and a path leading south.
Welcome to the cellar. It is dark and cold. A ladder leads up.
Your score has just gone up by one point. Your task is complete.
Use JSON. Respond with a JSON object like {"action": "hit"} or {"command": "open door"}.
Return your answer as JSON: {"action": "stick"}.
The output must be valid JSON with one key. Do not add any other text.
Grid world: you are at row 2, column 3. The goal is at row 4, column 4.
Avoid the holes. The ice is slippery. Reach the goal to get a reward.
You are a taxi. Pick up the passenger and drop them at the destination.
Actions: move up, move down, move left, move right, pick up, drop off.
Score, points, turn, step, level, player, opponent, board, move, piece.
Yes. No. OK. Done. Good. Bad. Maybe. Wait. Again. Please. Thank you.
What is your action? What is your next command? What do you do now?
I will hit. I will stick. I will go north. I will open the door. I will take the key.
The room is quiet. The light is on. The window is open. The floor is wet.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 100 1000
-1 -0.5 0.0 0.25 0.5 1.0 3.14 2.718 -273.15 42 7 99
a b c d e f g h i j k l m n o p q r s t u v w x y z
A B C D E F G H I J K L M N O P Q R S T U V W X Y Z
. , ; : ! ? ' " ( ) [ ] { } < > / \\ | - _ + = * & % $ # @ ~ ` ^
"""

_PROSE_TEXT = """\
Games are played by one or more players who follow a set of rules.
Some games are played with cards, some with dice, and some on a board with pieces.
In a card game each player is dealt a hand of cards from a shuffled deck.
The player who reaches the highest score before the end of the round is the winner.
A good strategy weighs the risk of each move against the possible reward.
When you are unsure, it is often better to take the safe option.
Learning means trying something, seeing what happens, and doing better next time.
An observation tells you what the world looks like right now.
An action changes the world, and the environment answers with a new observation.
The reward is a number that says how well the last action worked.
Over many episodes the agent should collect as much reward as it can.
The environment resets at the start of every episode.
A step is one action followed by one observation and one reward.
If the episode is truncated, it stopped because of a time limit.
If the episode is terminated, the game itself came to an end.
Read the whole message carefully before you answer.
Keep your answer short. Only write the action.
The player wins when the dealer busts and the player does not.
If both have the same sum, nobody wins and the bet is returned.
A natural is an ace with a ten card, and it is the best hand.
The house always has a small edge over the player.
A hard hand has no usable ace; a soft hand has one.
With a hard sixteen against a dealer ten, many players still hit.
With a soft eighteen, standing is usually a sound choice.
The cart moves along a frictionless track between two walls.
A force pushes the cart either to the left or to the right at every step.
The pole starts almost upright and begins to fall as soon as time passes.
Every step that the pole stays up earns one point of reward.
A small angle is easy to correct, but a large angle is hard to recover from.
Watch both the angle and the angular velocity before you decide.
The house has many rooms connected by doors and corridors.
Some doors are locked and need the right key to open.
Small items can be picked up, carried, and put down somewhere else.
Large furniture such as a bed, a sofa or a wardrobe cannot be moved.
Food can be eaten, and some recipes need food to be cooked first.
The chest in the attic holds something valuable.
A note on the kitchen table says the key is hidden under the mat.
The hallway connects the kitchen, the bedroom and the front door.
The bathroom has a sink, a mirror and a shower.
The living room has a sofa, a television and a bookshelf.
The study has a desk, a chair and a drawer full of papers.
It is raining outside, and the garden path is muddy.
A bird sings in the tree next to the shed.
You hear footsteps above you. Something moves in the dark.
The fire in the fireplace is warm and bright.
You feel hungry. You feel tired. You feel ready for an adventure.
Pick a number between one and ten. The number is seven.
Count from one to ten: one, two, three, four, five, six, seven, eight, nine, ten.
First, second, third, fourth, fifth, last. Before, after, again, never, always.
Up and down, left and right, inside and outside, near and far, over and under.
Red, green, blue, yellow, black, white, orange, purple, brown, gray.
Small, large, big, little, long, short, heavy, light, old, new, hot, cold.
Open it, close it, take it, leave it, use it, move it, push it, pull it.
The quick brown fox jumps over the lazy dog.
This sentence is written in plain English so the tokenizer learns common words.
Please think step by step, then give the final answer on its own line.
Final answer: hit. Final answer: stick. Final answer: LEFT. Final answer: RIGHT.
Thought: the sum is low, so another card is safe. Action: hit.
Thought: the sum is high, so another card may bust. Action: stick.
Thought: the pole leans right. Action: RIGHT.
Thought: the pole leans left. Action: LEFT.
Thought: the door is locked and I have the key. Command: unlock door with key.
Thought: I should explore the next room. Command: go east.
Error: unknown command. Try again with one of the listed commands.
Error: invalid JSON. Send an object with an action field.
Warning: the answer was too long and was cut off.
Hint: the treasure is in the chest behind the locked door.
Note: your inventory is limited to five items.
Tip: examine everything; the clues are in the descriptions.
Summary: three rooms explored, one key found, one door still locked.
Statistics: games played, games won, win rate, average reward, best score.
Training: batch, epoch, loss, learning rate, gradient, update, policy, value.
Tic-tac-toe is played on a three by three grid; get three in a row to win.
Place your mark in an empty square. The top left corner is square one.
In chess each side has a king, a queen, two rooks, two bishops, two knights and eight pawns.
Checkmate ends the game. A stalemate is a draw.
In a word game you guess a hidden word, letter by letter.
A correct letter in the correct spot is shown in green.
A correct letter in the wrong spot is shown in yellow.
In twenty questions you ask yes or no questions to find the secret object.
Is it an animal? Is it bigger than a bread box? Can you eat it?
The frozen lake has safe frozen tiles, holes, a start and a goal.
Moving on the slippery ice sometimes sends you in another direction.
The taxi must find the passenger, pick them up, and drive to the hotel, the station or the airport.
An illegal pick up or drop off costs a penalty.
The mountain car must build momentum by driving back and forth in the valley.
The lunar lander fires its main engine or its side engines to land softly between the flags.
Every environment has an observation space and an action space.
Discrete actions are numbered from zero. Continuous actions are real numbers.
Players take turns. It is your turn. It is the opponent's turn. Wait for your turn.
Roll the dice. You rolled a six. Move your piece forward six spaces.
Collect gold, avoid traps, and find the exit before the torch burns out.
The monster guards the bridge. Fight it, sneak past it, or turn back.
The merchant sells a rope, a lantern, a shield and a healing potion.
You have twenty gold coins. The potion costs five coins.
Your health is low. Drink the potion to restore your health.
The puzzle needs the red gem, the blue gem and the green gem.
Solve the riddle to open the gate: what has keys but cannot open locks?
The answer is a piano. The gate opens with a loud creak.
"""

_SYSTEM_PROMPTS = (
    "You are a helpful agent playing a game.",
    "You are an expert Blackjack player.",
    "You control a cart that balances a pole.",
    "You are exploring a house in a text adventure.",
    "Answer with one action only.",
    "Respond in JSON.",
)

# fmt: off
_ROOMS = (
    "kitchen", "bedroom", "bathroom", "living room", "cellar",
    "attic", "garden", "hallway", "study",
)
_OBJECTS = (
    "door", "key", "chest", "table", "apple", "book", "lamp", "box", "coin",
    "sword", "map", "bottle", "knife", "letter", "carrot", "fridge", "drawer",
)
_VERBS = ("take", "open", "drop", "examine", "eat", "close", "unlock")
_DIRECTIONS = ("north", "south", "east", "west")
_CARD_NAMES = (
    "ace", "two", "three", "four", "five", "six", "seven",
    "eight", "nine", "ten", "jack", "queen", "king",
)
# fmt: on
_SUITS = ("hearts", "diamonds", "clubs", "spades")


def _blackjack_lines() -> list[str]:
    lines = []
    for player_sum in range(4, 22):
        for dealer in range(1, 11):
            ace = "a" if (player_sum + dealer) % 3 == 0 else "no"
            action = "hit" if player_sum < 17 else "stick"
            lines.append(
                f"Your sum is {player_sum}, the dealer's showing card is {dealer}, "
                f"and you have {ace} usable ace. Action: {action}"
            )
    for dealer in range(1, 11):
        lines.append(
            f"Your sum: {dealer + 10}. Dealer: {dealer}. Usable ace: no. Do you stick or hit?"
        )
        lines.append(
            f'{{"action": "hit"}} {{"action": "stick"}} {{"action": "stay"}} dealer {dealer}'
        )
    return lines


def _cartpole_lines() -> list[str]:
    lines = []
    for i in range(60):
        # Fixed arithmetic, not random numbers, so the corpus is identical everywhere.
        pos = ((i * 37) % 480 - 240) / 100
        vel = ((i * 53) % 400 - 200) / 100
        ang = ((i * 29) % 418 - 209) / 1000
        ang_vel = ((i * 71) % 600 - 300) / 100
        action = "LEFT" if ang < 0 else "RIGHT"
        lines.append(
            f"Cart position: {pos:.3f}, Cart velocity: {vel:.3f}, "
            f"Pole angle: {ang:.3f}, Pole angular velocity: {ang_vel:.3f}. Action: {action}"
        )
    return lines


def _text_adventure_lines() -> list[str]:
    lines = []
    for room_index, room in enumerate(_ROOMS):
        obj = _OBJECTS[room_index % len(_OBJECTS)]
        other = _OBJECTS[(room_index * 5 + 3) % len(_OBJECTS)]
        direction = _DIRECTIONS[room_index % len(_DIRECTIONS)]
        title = room.title()
        lines.append(f"-= {title} =- You are in the {room}. You see a {obj} and a {other}.")
        lines.append(
            f"There is an exit to the {direction}. Type go {direction} to leave the {room}."
        )
    for verb in _VERBS:
        for obj in _OBJECTS:
            lines.append(f'> {verb} {obj} {{"command": "{verb} {obj}"}}')
    for direction in _DIRECTIONS:
        lines.append(f'> go {direction} {{"command": "go {direction}"}} You go {direction}.')
    for obj in _OBJECTS[:8]:
        lines.append(f"> put {obj} on table. You put the {obj} on the table.")
        lines.append(f"> put {obj} in chest. You put the {obj} in the chest.")
    lines.append('> look {"command": "look"} > inventory {"command": "inventory"}')
    return lines


def _card_lines() -> list[str]:
    return [f"You draw the {card} of {suit}." for suit in _SUITS for card in _CARD_NAMES]


def _chat_lines() -> list[str]:
    lines = []
    answers = ("hit", "stick", "LEFT", "RIGHT", "go north", "open door", "take key", "look")
    for i, system in enumerate(_SYSTEM_PROMPTS):
        answer = answers[i % len(answers)]
        lines.append(
            f"{SYSTEM_TOKEN}\n{system}{END_TOKEN}\n{USER_TOKEN}\nWhat is your action?{END_TOKEN}\n"
            f"{ASSISTANT_TOKEN}\n{answer}{END_TOKEN}"
        )
    return lines


def training_corpus() -> list[str]:
    """The fixed lines the tiny tokenizer is trained on (same list every call)."""
    texts = (_BASE_TEXT, _PROSE_TEXT)
    lines = [line for text in texts for line in text.splitlines() if line.strip()]
    lines += _blackjack_lines()
    lines += _cartpole_lines()
    lines += _text_adventure_lines()
    lines += _card_lines()
    lines += _chat_lines()
    return lines


# --------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------


def default_tiny_model_dir(seed: int = 0) -> Path:
    """Cache location of the tiny model for ``seed``."""
    return models_cache_dir() / f"tiny-v{TINY_MODEL_VERSION}-seed{seed}"


def build_tokenizer() -> Any:
    """Train the tiny byte-level BPE tokenizer; returns a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # Only fixes offsets; it adds no bos/eos, so prompts are exactly what the
    # chat template renders.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 bytes up front, so nothing is ever out of vocabulary.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        eos_token=END_TOKEN,
        # GPT-2 style: the end token doubles as bos. It is never inserted
        # automatically; it only gives the model config a valid bos id.
        bos_token=END_TOKEN,
        additional_special_tokens=[SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN],
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build_into(directory: Path, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **MODEL_CONFIG,
    )
    # fork_rng keeps the caller's global RNG state untouched while the weight
    # init draws from a seeded stream.
    with _build_lock, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model = model.to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    # transformers 5 records its internal class name (TokenizersBackend);
    # PreTrainedTokenizerFast names the same thing and older releases know it.
    tokenizer_config_path = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text(encoding="utf-8"))
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config_path.write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    info = {
        "name": "tiny",
        "version": TINY_MODEL_VERSION,
        "seed": seed,
        "parameters": model.num_parameters(),
        "vocab_size": len(tokenizer),
    }
    # Written last: its presence means the directory is complete.
    (directory / _BUILD_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def _is_complete(directory: Path, seed: int) -> bool:
    """True if ``directory`` holds a finished build of this version and seed."""
    try:
        info = json.loads((directory / _BUILD_INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return info.get("version") == TINY_MODEL_VERSION and info.get("seed") == seed


def build_tiny_model(
    directory: Path | None = None, *, seed: int = 0, overwrite: bool = False
) -> Path:
    """Build the tiny model and tokenizer into ``directory`` (or reuse a cached build).

    The result loads with ``AutoModelForCausalLM.from_pretrained(path)`` and
    ``AutoTokenizer.from_pretrained(path)``. The build happens in a temporary
    sibling directory that is renamed into place, so a crash never leaves a
    half-written model, and concurrent builders cannot corrupt each other: the
    first rename wins and later builders discard their copy.
    """
    target = Path(directory) if directory is not None else default_tiny_model_dir(seed)
    target = target.expanduser()
    if _is_complete(target, seed) and not overwrite:
        return target

    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = f".{target.name}.tmp-"
    remove_stale_temp_dirs(parent, tmp_prefix)

    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=parent))
    try:
        _build_into(tmp, seed)
        # mkdtemp makes the directory private (0700); the finished model is
        # ordinary readable data like the rest of the cache.
        tmp.chmod(0o755)
        if overwrite and target.exists():
            # Move the old build aside: publishing replaces only an incomplete one.
            trash = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=parent))
            with contextlib.suppress(FileNotFoundError):  # someone else moved it first
                os.replace(target, trash / "old")
            shutil.rmtree(trash, ignore_errors=True)
        # Another builder may have renamed its copy into place first; theirs is as good
        # as ours (same seed, same bytes).
        if not publish_directory(tmp, target, lambda found: _is_complete(found, seed)):
            logger.debug("tiny model already built at %s by another process", target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny model in %s (%.1fs)", target, time.perf_counter() - started)
    return target
