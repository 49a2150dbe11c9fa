"""GSM8K rule reward, the reward registry (names and dotted paths) and reward-model scoring."""

import json
import pathlib
import textwrap

import pytest
import torch

from megarl.rewards import RewardError, load_reward_fn
from megarl.rewards.gsm8k import extract_answer, ground_truth_number, gsm8k_reward, normalize_number
from megarl.rewards.reward_model import RewardModel

GSM8K_TEST = pathlib.Path("/work/shared/data/gsm8k/test.jsonl")


@pytest.mark.parametrize("text, expected", [
    ("72", "72"), (" $1,234.50 ", "1234.5"), ("72.0", "72"), ("-0", "0"), ("50%", "50"), ("18.", "18"),
    ("\u22125", "-5"), ("0.250", "0.25"), ("100", "100"), ("abc", None), ("", None), ("nan", None),
])
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize("response, expected", [
    ("She sold 48 + 24 = 72 clips.\n#### 72", ("72", True)),
    ("####72", ("72", True)),
    ("#### $1,234 in total", ("1234", True)),
    ("#### 5\nWait, no.\n#### 6", ("5", True)),                          # the first stated answer counts
    ("#### -3.50", ("-3.5", True)),
    ("So the answer is \\boxed{18 \\text{ dollars}}. Check: 9 * 2", ("18", False)),
    ("\\boxed{1} then \\boxed{\\frac{3}{4}}", ("0.75", False)),            # the last box
    ("\\boxed{\u22124}", ("-4", False)),
    ("#### unknown", (None, False)),
    ("no numbers here", (None, False)),
])
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


# What lm-evaluation-harness's strict-match (#### (\-?[0-9\.\,]+)), verl's gsm8k.py and math-verify read, and the
# readings that none of them (or no sound reading) gives: the module docstring states the rules.
@pytest.mark.parametrize("response, expected", [
    ("\\boxed{8{,}000}", "8000"),                         # LaTeX's thousands comma (was read as 8)
    ("so \\boxed{5 + 3 = 8}", "8"),                         # an equation: its result (was 5), as math-verify
    ("\\boxed{x \\approx 8}", "8"),
    ("#### +5", "5"),                                       # a leading plus (was no answer)
    ("#### 1 000", "1000"), ("#### 1\u2009000", "1000"), ("#### 1\u202f000", "1000"),   # space groups
    ("\\boxed{1\\,000}", "1000"), ("\\boxed{1\\!,\\!000}", "1000"), ("\\boxed{1~000}", "1000"),
    ("#### 1,000,000", "1000000"), ("#### $1,234,567.50", "1234567.5"),
    ("#### 5.00", "5"), ("#### $5.00 dollars", "5"), ("#### 5.", "5"), ("#### .5", "0.5"),
    ("\\boxed{\\$1{,}234.50}", "1234.5"), ("\\boxed{\\text{\\$}18}", "18"), ("\\boxed{50\\%}", "50"),
    ("\\boxed{\\frac{16}{2}}", "8"), ("\\boxed{-\\dfrac{3}{4}}", "-0.75"), ("\\fbox{12}", "12"),
    ("#### 72 clips in all", "72"), ("#### 5-3=2", "5"),    # the number right after ####, as the harnesses
    ("#### unknown\n#### 7", "7"),                          # the first #### that has a number
    # must NOT be read as a number
    ("#### 1,00", None), ("#### 12,5", None), ("#### 1,0000", None), ("#### 1.000.000", None),
    ("#### 12,34", None), ("#### 123,45,678", None), ("#### 1,00,00", None),   # no Indian grouping either
    ("#### 10:30", None),                                   # a separator that groups no three digits
    ("\\boxed{5+3}", None), ("\\boxed{2x}", None), ("\\boxed{8, 9}", None),   # not one number
    ("\\boxed{x = 5 \\leq 7}", None), ("\\boxed{\\frac{1}{3}}", "1/3"),  # 1/3 equals no decimal answer
])
def test_extract_answer_number_spellings(response, expected):
    assert extract_answer(response)[0] == expected


# Digit groupings that lm-evaluation-harness's gsm8k filters accept, with the values they give, derived by hand
# from their rules: strict-match takes the first "#### (\-?[0-9\.\,]+)", flexible-extract the last
# "(-?[$0-9.,]{2,})|(-?[0-9]+)"; both then drop "$", "," and a final "." (exact_match's regexes_to_ignore).
# verl's gsm8k.py reads the same digits ("#### (\-?[0-9\.\,]+)" or the last "(\-?[0-9\.\,]+)", "," and "$"
# dropped) but keeps a final ".". megarl must give each of them the same value (issue 33: the Indian groupings
# "1,00,000" and "12,34,567" were no answer).
@pytest.mark.parametrize("response, expected", [
    # strict: "#### 1,000" -> "1,000" -> "1000"
    ("#### 1,000", "1000"), ("#### 1,234,567", "1234567"), ("#### -1,000", "-1000"),
    ("#### 1,000.", "1000"),                        # the final "." dropped (lm-eval); verl's "1000." would miss
    ("#### 1,234.5", "1234.5"), ("#### -1,234,567.25.", "-1234567.25"), ("#### 10,000, in all", "10000"),
    ("#### 1,00,000", "100000"), ("#### 12,34,567", "1234567"),           # Indian lakh / crore grouping
    ("#### 1,23,45,678", "12345678"), ("#### -1,00,000.", "-100000"), ("#### 2,50,000.75", "250000.75"),
    # flexible: the last number, "$" dropped: "costs $1,234." -> "$1,234." -> "1234"
    ("It costs $1,234.", "1234"), ("It costs -$1,000", "-1000"), ("so 1,00,000 rupees", "100000"),
    ("a total of 12,34,56,789.", "123456789"), ("then 7 and finally 1,000,000.", "1000000"),
    ("\\boxed{1,00,000}", "100000"), ("\\boxed{12{,}34{,}567}", "1234567"),   # LaTeX's comma
])
def test_extract_answer_matches_the_harnesses_digit_groupings(response, expected):
    got = extract_answer(response, last_number=True)[0]
    assert got == expected
    if expected is not None:
        assert gsm8k_reward([""], [response], [expected], last_number=True) == [1.0]


def test_number_spellings_score_as_their_value():
    responses = ["#### +72", "\\boxed{8{,}000}", "\\boxed{3 \\times 4 = 12}", "#### 1 000", "#### 1,00"]
    assert gsm8k_reward([""] * 5, responses, ["72", "8000", "12", "1000", "100"]) == [1.0, 1.0, 1.0, 1.0, 0.0]


def test_space_groups_only_in_an_answer():
    # In running text ("flexible extract") a space separates numbers: "3 100-page books" is not 3100.
    assert extract_answer("He bought 3 100", last_number=True) == ("100", False)
    assert extract_answer("5-3=2 and 1,00", last_number=True) == ("2", False)


@pytest.mark.parametrize("response, expected", [
    ("3 apples and 4 pears make 7.", "7"),
    ("It costs 1,000 dollars", "1000"),
    ("5-3=2", "2"),
    ("The answer is \u22124", "-4"),
])
def test_extract_answer_last_number_is_opt_in(response, expected):
    assert extract_answer(response, last_number=True) == (expected, False)
    assert extract_answer(response) == (None, False)


def test_cut_off_response_is_not_correct_by_default():
    # A response cut at the length limit that ends with the problem's own number, equal to the answer.
    cut = "Step 1: the tank holds 15 liters. We know that 15 liters of pineapple"
    assert gsm8k_reward([""], [cut], ["15"]) == [0.0]
    assert gsm8k_reward([""], [cut], ["15"], last_number=True) == [1.0]


def test_extract_answer_strict_accepts_only_the_hash_format():
    assert extract_answer("the answer is 72", strict=True) == (None, False)
    assert extract_answer("\\boxed{72}", strict=True) == (None, False)
    assert extract_answer("#### 72", strict=True) == ("72", True)


def test_gsm8k_reward_scores():
    responses = ["#### 72", "The total is 72 clips.", "#### 71", "I don't know.", "#### 1,000.00", "#### 7"]
    truths = ["72", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", "72", "72", "1000", "7"]
    assert gsm8k_reward([""] * 6, responses, truths) == [1.0, 0.0, 0.1, 0.0, 1.0, 1.0]
    assert gsm8k_reward([""] * 6, responses, truths, last_number=True) == [1.0, 1.0, 0.1, 0.0, 1.0, 1.0]
    assert gsm8k_reward([""] * 6, responses, truths, format_score=0.0, strict=True, correct_score=2.0) == \
        [2.0, 0.0, 0.0, 0.0, 2.0, 2.0]
    with pytest.raises(RewardError, match="sample 1 has no ground truth"):
        gsm8k_reward(["", ""], ["#### 1", "#### 2"], ["1", None])
    with pytest.raises(RewardError, match="no number"):
        ground_truth_number("#### many")


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason="GSM8K copy not present")
def test_every_reference_solution_of_the_test_split_scores_one():
    rows = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines()]
    truths = [ground_truth_number(r["answer"]) for r in rows]
    assert len(rows) == 1319 and all(t.lstrip("-").replace(".", "").isdigit() for t in truths)
    assert gsm8k_reward([""] * len(rows), [r["answer"] for r in rows], truths) == [1.0] * len(rows)


# ---------------------------------------------------------------------------------------------- registry
def test_arithmetic_reward_reads_the_final_number():
    from megarl.rewards.arithmetic import arithmetic_reward

    responses = ["7 + 12 = 19", "19.", "The answer is 19", "7 + 12 = 19, or 20", "nineteen", "#### 19\nso 20",
                 "\\boxed{19}", "-19"]
    assert arithmetic_reward([""] * 8, responses, ["19"] * 8) == [1, 1, 1, 0, 0, 1, 1, 0]
    with pytest.raises(RewardError, match=r"sample 1: ground truth 'x' is not a number.*data.answer_key"):
        arithmetic_reward(["", ""], ["1", "2"], ["1", "x"])


def test_load_builtin_by_name_returns_a_tensor_and_binds_params():
    fn = load_reward_fn("gsm8k", {"format_score": 0.25})
    torch.testing.assert_close(fn(["q", "q"], ["#### 3", "#### 4"], ["4", "4"]), torch.tensor([0.25, 1.0]))
    with pytest.raises(RewardError, match="does not accept parameters \\['fmt'\\].*format_score"):
        load_reward_fn("gsm8k", {"fmt": 0.1})
    with pytest.raises(RewardError, match="got 1 prompts, 2 responses"):
        fn(["q"], ["a", "b"], ["1", "2"])


def test_unknown_name_lists_the_builtins():
    with pytest.raises(ValueError, match=r"unknown reward function 'gsm9k'.*'gsm8k'.*'reward_model'"):
        load_reward_fn("gsm9k")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def length_reward(prompts, responses, ground_truths, scale=1.0):
            return [scale * len(r) for r in responses]

        def wrong_count(prompts, responses, ground_truths):
            return [0.0]

        def nan_reward(prompts, responses, ground_truths):
            return [float("nan"), None, float("-inf"), 1.0][:len(responses)]

        def word_reward(prompts, responses, ground_truths):
            return ["good"] * len(responses)

        class Constant:
            def __init__(self, value):
                self.value = value

            def __call__(self, prompts, responses, ground_truths):
                return [self.value] * len(responses)
    """))
    (tmp_path / "broken_rewards.py").write_text("import package_that_does_not_exist\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


@pytest.mark.parametrize("spec", ["my_rewards:length_reward", "my_rewards.length_reward"])
def test_user_function_by_dotted_path(user_module, spec):
    fn = load_reward_fn(spec, {"scale": 0.5})
    torch.testing.assert_close(fn(["p", "p"], ["abcd", "ab"], None), torch.tensor([2.0, 1.0]))


def test_user_class_by_path_is_instantiated_with_params(user_module):
    fn = load_reward_fn("my_rewards:Constant", {"value": 3.0})
    torch.testing.assert_close(fn(["p"], ["r"], [None]), torch.tensor([3.0]))


def test_user_path_errors(user_module):
    with pytest.raises(RewardError, match="cannot import module 'broken_rewards'.*package_that_does_not_exist"):
        load_reward_fn("broken_rewards:fn")
    with pytest.raises(RewardError, match="cannot import module 'no_such_module'.*PYTHONPATH"):
        load_reward_fn("no_such_module.fn")
    with pytest.raises(RewardError, match="has no attribute 'missing'"):
        load_reward_fn("my_rewards:missing")
    with pytest.raises(RewardError, match="one float per response"):
        load_reward_fn("my_rewards:wrong_count")(["p", "p"], ["a", "b"], None)
    with pytest.raises(RewardError, match=r"returned \['good', 'good'\], which is not one float per response"):
        load_reward_fn("my_rewards:word_reward")(["p", "p"], ["a", "b"], None)
    with pytest.raises(RewardError, match=r"'my_rewards:Constant' does not accept parameters \['val'\].*"
                                          r"Constant\(value\)"):
        load_reward_fn("my_rewards:Constant", {"val": 1})


def test_no_score_comes_back_as_nan_for_the_trainer_to_drop(user_module):
    """None, NaN and infinities are "no score" (megarl.algos.nonfinite drops the sample), not an error."""
    scores = load_reward_fn("my_rewards:nan_reward")(["p"] * 4, ["a", "b", "c", "d"], None)
    assert scores.dtype == torch.float32 and scores[3] == 1.0
    assert torch.isnan(scores[:2]).all() and scores[2] == float("-inf")


def test_reward_parameters_of_the_wrong_type_are_refused_before_any_call():
    with pytest.raises(RewardError, match="format_score='high' is a str, but reward 'gsm8k' takes a float there"):
        load_reward_fn("gsm8k", {"format_score": "high"})
    with pytest.raises(RewardError, match="strict=1 is a int, but reward 'gsm8k' takes a bool"):
        load_reward_fn("gsm8k", {"strict": 1})
    load_reward_fn("gsm8k", {"format_score": 0, "strict": True})  # an int is a float


# ---------------------------------------------------------------------------------------------- reward model
WORDS = ["<pad>", "<unk>", "<s>"] + "user assistant : what is 1 2 3 4 5 the answer yes no ok".split()


def tiny_tokenizer(chat_template=None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>")
    out.chat_template = chat_template
    return out


@pytest.fixture(scope="module")
def tiny_rm_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0)
    path = tmp_path_factory.mktemp("tiny_rm")
    LlamaForSequenceClassification(config).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_reward_model_batched_scores_equal_unpadded_forwards(tiny_rm_dir):
    prompts = ["what is 1 2", "what is", "the answer", "what is 5"]
    responses = [" yes", " 3 4 5 ok no", " no", " 2"]
    fn = load_reward_fn("reward_model", {"model": str(tiny_rm_dir), "batch_size": 3})
    scores = fn(prompts, responses, None)
    rm = RewardModel(str(tiny_rm_dir))
    expected = []
    for p, r in zip(prompts, responses):
        ids = rm.tokenizer(p + r)["input_ids"]
        expected.append(rm.model(input_ids=torch.tensor([ids])).logits[0, 0].item())
    torch.testing.assert_close(scores, torch.tensor(expected))
    assert len(set(expected)) == len(expected)                     # the scores depend on the text
    short = RewardModel(str(tiny_rm_dir), max_length=2)(prompts[:1], responses[:1])
    last_two = rm.tokenizer(prompts[0] + responses[0])["input_ids"][-2:]
    assert short == pytest.approx([rm.model(input_ids=torch.tensor([last_two])).logits[0, 0].item()])


def test_reward_model_chat_template_and_errors(tiny_rm_dir):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_rm_dir)
    template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    rm = RewardModel(model, tiny_tokenizer(template))
    assert rm.texts(["what is 2"], ["yes"]) == ["user : what is 2 assistant : yes "]
    ids = rm.tokenizer("user : what is 2 assistant : yes ", add_special_tokens=False)["input_ids"]
    assert rm(["what is 2"], ["yes"]) == pytest.approx([model(input_ids=torch.tensor([ids])).logits[0, 0].item()])
    with pytest.raises(RewardError, match="needs its tokenizer"):
        RewardModel(model)
    with pytest.raises(RewardError, match="no chat template"):
        RewardModel(model, tiny_tokenizer(), chat_template=True)
    with pytest.raises(RewardError, match="label_index=1 but the reward model has 1 labels"):
        RewardModel(model, tiny_tokenizer(), label_index=1)
