"""GSM8K answer extraction on tricky completions, prompt building and dataset loading."""

from __future__ import annotations

import json

import pytest

from vllm_ling.bench import gsm8k

# (completion, strict answer, flexible answer); strict is only the "#### N" form.
CASES = [
    ("She sells 9 eggs at $2 each, so 9 * 2 = 18.\n#### 18", "18", "18"),
    ("The total is $1,234.\n#### $1,234.", "1234", "1234"),  # dollar, comma, trailing period
    ("#### 1,000,000", "1000000", "1000000"),
    ("####18", "18", "18"),  # no space after the marker
    ("It fell to -5 degrees.\n#### -5", "-5", "-5"),  # negative
    ("#### $-4", "-4", "-4"),
    ("Each costs 2.50, so 3 cost 7.50.\n#### 7.50", "7.5", "7.5"),  # decimals normalize 7.50 == 7.5
    ("So the answer is 18.00 dollars.", None, "18"),  # no marker: strict fails, flexible works
    ("First 12, then 30, finally 42.", None, "42"),  # several numbers: the last one
    ("5-3 = 2", None, "2"),  # a minus between numbers is not a sign
    ("He had 10 apples and ate -3 ... no wait, the result is .5 of them", None, "0.5"),
    ("I cannot solve this.", None, None),  # no number at all
    ("", None, None),
    ("#### \n", None, None),  # marker without a number
    ("#### 72\nQuestion: A farmer has 3 cows", "72", "72"),  # invented follow-up question ignored
    ("The answer is 40. #### 40. Then 99 more.", "40", "99"),  # strict takes the marker, flexible the last
]


@pytest.mark.parametrize("completion,strict,flexible", CASES)
def test_extraction(completion, strict, flexible):
    assert gsm8k.extract_strict(completion) == strict
    assert gsm8k.extract_flexible(completion) == flexible


def test_score_uses_normalized_gold():
    s = gsm8k.score("so $1,800.\n#### 1,800", gsm8k.gold_answer("... #### 1800"))
    assert s["correct_strict"] and s["correct_flexible"]
    s = gsm8k.score("I think 17", "18")
    assert not s["correct_strict"] and not s["correct_flexible"]


def test_packaged_dataset_has_all_test_questions():
    qs = gsm8k.load_questions()
    assert len(qs) == 1319
    assert qs[0].answer == "18"  # Janet's ducks
    assert all(gsm8k.normalize_number(q.answer) == q.answer for q in qs)


def test_prompt_is_five_shot_and_ends_with_question():
    prompt = gsm8k.build_prompt("What is 2 + 2?")
    assert prompt.count("Question:") == 6
    assert prompt.endswith("Question: What is 2 + 2?\nAnswer:")
    # every built-in exemplar teaches the strict form and its own arithmetic is right
    for _, answer in gsm8k.EXEMPLARS:
        assert gsm8k.extract_strict(answer) is not None


def test_fewshot_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"a\n#### {i}"}) + "\n" for i in range(7)))
    shots = gsm8k.exemplars_from_file(str(path))
    assert [q for q, _ in shots] == ["q0", "q1", "q2", "q3", "q4"]
    assert gsm8k.build_prompt("x", shots).startswith("Question: q0\nAnswer: a\n#### 0\n\n")
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    with pytest.raises(gsm8k.DatasetError, match="needs 5 rows"):
        gsm8k.exemplars_from_file(str(short))


def test_bad_dataset_errors_name_the_file(tmp_path):
    with pytest.raises(gsm8k.DatasetError, match="--dataset .*not found"):
        gsm8k.load_questions(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(gsm8k.DatasetError, match="bad.jsonl:1"):
        gsm8k.load_questions(str(bad))
