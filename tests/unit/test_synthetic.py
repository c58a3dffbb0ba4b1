"""Synthetic tasks (data/synthetic.py): deterministic records, strict verifiers, the char tokenizer."""

import json
import random

import pytest

from megatron_jetrl.config import ConfigError
from megatron_jetrl.data.synthetic import CHAIN_INCREMENT, CHAIN_MULTIPLIER, MAX_RESPONSE_CHARS, TASKS, CharTokenizer

CD = TASKS["countdown"]
AR = TASKS["arithmetic"]
CD_ANSWER = {"numbers": [3, 5, 7], "target": 22}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_generate_is_deterministic_by_seed(name):
    task = TASKS[name]
    a = task.generate(50, seed=3)
    assert a == task.generate(50, seed=3)
    assert a != task.generate(50, seed=4)
    assert task.generate(20, seed=3) == a[:20]
    assert task.generate(0, seed=3) == []
    json.dumps(a)


@pytest.mark.parametrize("name,options", [
    ("countdown", {}),
    ("countdown", {"num_numbers": 4, "max_number": 20, "ops": "+-*/"}),
    ("countdown", {"num_numbers": 2, "min_number": 0, "max_number": 3, "ops": "-"}),
    ("arithmetic", {}),
    ("arithmetic", {"digits": 3, "ops": "+-*"}),
    ("chain", {}),
    ("chain", {"length": 64}),
])
def test_solutions_score_one_after_json_round_trip(name, options):
    task = TASKS[name]
    tok = task.tokenizer()
    for rec in task.generate(300, seed=0, **options):
        answer = json.loads(json.dumps(rec["answer"]))
        assert task.score(rec["solution"], answer) == 1.0, rec
        assert task.score(f" {rec['solution']}\n", answer) == 1.0
        assert tok.eos_token_id not in tok.encode(rec["prompt"] + rec["solution"])


def test_countdown_record_layout():
    for rec in CD.generate(100, seed=1, num_numbers=4):
        nums, target = rec["answer"]["numbers"], rec["answer"]["target"]
        assert len(nums) == 4 and all(1 <= n <= 9 for n in nums)
        assert rec["prompt"] == " ".join(map(str, nums)) + f">{target}="
        assert isinstance(target, int) and target >= 0


def test_countdown_accepts_any_correct_expression():
    for response in ["3*5+7", "7+5*3", "(5*3)+7", "7 + 3 * 5", "((3*5)+(7))"]:
        assert CD.score(response, CD_ANSWER) == 1.0, response
    # non-integer intermediates are fine when the result is exact
    assert CD.score("6/4*2+5", {"numbers": [6, 4, 2, 5], "target": 8}) == 1.0


@pytest.mark.parametrize("response", [
    "", "   ", "3*5+8", "3*5+7+7", "3*5", "3*5*7", "35+7",  # wrong value, reused or missing numbers
    "3*5+7=22", "3*5+7 extra", "3*5+7\n3", "22",  # trailing text, bare target
    "(3*5+7", "3*5+7)", "((3*5)+7", ")(", "()", "3**5+7", "3*+5+7", "-3+5*7", "+3*5+7",
    "7/0", "3*5+7/(5-5)", "1/0",
    "03*5+7", "3.0*5+7", "3*5+7.", "\u0663*5+7",  # leading zero, decimals, non-ASCII digit
    "(" * 10_000 + "3" + ")" * 10_000, "3+" * 100_000 + "3", "9" * 1_000_000,
    "(" * (MAX_RESPONSE_CHARS // 2 - 1) + "3*5+7" + ")" * (MAX_RESPONSE_CHARS // 2 - 1),
])
def test_countdown_wrong_or_hostile_scores_zero(response):
    assert CD.score(response, CD_ANSWER) == 0.0


def test_countdown_division_by_zero_and_length_cap():
    assert CD.score("1/(2-2)+3", {"numbers": [1, 2, 2, 3], "target": 3}) == 0.0
    deep = "(" * 20 + "3*5+7" + ")" * 20
    assert len(deep) <= MAX_RESPONSE_CHARS and CD.score(deep, CD_ANSWER) == 1.0


@pytest.mark.parametrize("response,want", [
    ("408", 1.0), (" 408\n", 1.0), ("0408", 0.0), ("4080", 0.0), ("408=408", 0.0),
    ("+408", 0.0), ("", 0.0), ("4" * 1_000_000, 0.0), ("408\ufffd", 0.0),
])
def test_arithmetic_score(response, want):
    assert AR.score(response, 408) == want


def test_arithmetic_negative_answers():
    recs = AR.generate(200, seed=0, ops="-")
    assert any(r["answer"] < 0 for r in recs)
    assert all(AR.score(r["solution"], r["answer"]) == 1.0 for r in recs)


def test_tokenizer_round_trip_and_specials():
    tok = CD.tokenizer()
    assert tok is AR.tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.chat_template is None and len(tok) == tok.vocab_size
    text = "12 3 (4+5)*6/7-8=9>0 ok?"
    ids = tok.encode(text)
    assert len(ids) == len(text) and all(3 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_token_id, *ids, tok.eos_token_id, tok.pad_token_id]) == text
    assert tok.decode([tok.bos_token_id, *ids[:2]], skip_special_tokens=False) == "<bos>12"
    assert tok.encode("1", add_special_tokens=True) == [tok.bos_token_id, *tok.encode("1")]
    assert tok.decode([*tok.encode("7"), tok.vocab_size, 127]) == "7\ufffd\ufffd"
    for name in TASKS:
        for rec in TASKS[name].generate(100, seed=0):
            for text in (rec["prompt"], rec["solution"]):
                assert tok.decode(tok.encode(text)) == text
    assert CharTokenizer().vocab_size == tok.vocab_size


@pytest.mark.parametrize("text", ["3+4#", "A", "é", "\t"])
def test_tokenizer_unknown_character(text):
    with pytest.raises(ValueError, match="not in the synthetic vocabulary"):
        CD.tokenizer().encode(text)


def test_options_validation():
    with pytest.raises(ConfigError, match=r"synthetic\.options.*num_numbers") as e:
        CD.generate(4, seed=0, digits=2)
    assert e.value.key == "synthetic.options" and e.value.got == ["digits"]
    with pytest.raises(ConfigError, match="digits"):
        AR.generate(4, seed=0, num_numbers=2)
    with pytest.raises(ConfigError) as e:
        CD.generate(4, seed=0, ops="+^")
    assert e.value.key == "synthetic.options.ops"
    with pytest.raises(ConfigError) as e:
        CD.generate(0, seed=0, num_numbers=1)
    assert e.value.key == "synthetic.options.num_numbers"
    with pytest.raises(ConfigError) as e:
        CD.generate(4, seed=0, min_number=5, max_number=3)
    assert e.value.key == "synthetic.options.max_number"
    with pytest.raises(ConfigError) as e:
        AR.generate(4, seed=0, digits=True)
    assert e.value.key == "synthetic.options.digits"


def test_option_errors_name_the_callers_key():
    """The dataset loader passes its own key (data.train or data.eval), so an eval option is not
    blamed on the train set; so is the countdown range that allows no target."""
    key = "data.eval.synthetic.options"
    with pytest.raises(ConfigError) as e:
        CD.generate(4, seed=0, options_key=key, bogus=1)
    assert e.value.key == key and e.value.got == ["bogus"]
    with pytest.raises(ConfigError) as e:
        CD.generate(4, seed=0, options_key=key, num_numbers=99)
    assert e.value.key == f"{key}.num_numbers"
    with pytest.raises(ConfigError, match="no non-negative integer target") as e:
        CD.generate(4, seed=0, options_key=key, min_number=0, max_number=0, ops="/")
    assert e.value.key == key


@pytest.mark.parametrize("name", sorted(TASKS))
def test_random_responses_never_raise(name):
    task, rng = TASKS[name], random.Random(0)
    alphabet = "0123456789+-*/()= x\ufffd"
    rec = task.generate(1, seed=0)[0]
    for _ in range(3000):
        response = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        assert task.score(response, rec["answer"]) in (0.0, 1.0)


CH = TASKS["chain"]


def test_chain_record_layout_and_partial_credit():
    rec = CH.generate(1, seed=3, length=4)[0]
    seed = rec["answer"]["seed"]
    assert rec["prompt"] == f"{seed:02d}>" and rec["answer"] == {"seed": seed, "length": 4}
    xs, x = [], seed
    for _ in range(4):
        x = (21 * x + 37) % 100
        xs.append(x)
    assert rec["solution"] == " ".join(f"{v:02d}" for v in xs)
    assert CH.score(rec["solution"], rec["answer"]) == 1.0
    wrong_third = rec["solution"].split(" ")
    wrong_third[2] = f"{(xs[2] + 1) % 100:02d}"
    assert CH.score(" ".join(wrong_third), rec["answer"]) == 0.5  # credit stops at the first wrong entry
    assert CH.score(" ".join(rec["solution"].split(" ")[:3]), rec["answer"]) == 0.75  # a cut-off answer
    assert CH.score(rec["solution"] + " 00", rec["answer"]) == 0.0  # more entries than asked for
    assert CH.score(rec["solution"].replace(" ", ","), rec["answer"]) == 0.0
    assert CH.score(rec["solution"], json.loads(json.dumps(rec["answer"]))) == 1.0  # answers stored as JSON


def test_chain_map_has_full_period():
    # Every seed walks all 100 values: no seed falls into a short cycle that is easier to learn,
    # and no answer repeats an entry.
    x, orbit = 0, set()
    for _ in range(100):
        x = (CHAIN_MULTIPLIER * x + CHAIN_INCREMENT) % 100
        orbit.add(x)
    assert orbit == set(range(100))
    for rec in CH.generate(20, seed=1, length=64):
        assert len(set(rec["solution"].split(" "))) == 64


def test_chain_long_responses_are_allowed_up_to_its_own_cap():
    rec = CH.generate(1, seed=0, length=64)[0]
    assert len(rec["solution"]) == 3 * 64 - 1 > MAX_RESPONSE_CHARS
    assert CH.score(rec["solution"], rec["answer"]) == 1.0
    assert CH.score("1" * (CH.max_response_chars + 1), rec["answer"]) == 0.0
    with pytest.raises(ConfigError, match="length"):
        CH.generate(1, seed=0, length=65)
