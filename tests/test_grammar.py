"""Constrained decoding: the output follows the grammar, and speculation under a grammar equals constrained plain
decoding (greedy token for token, sampling in distribution), whatever the drafts propose."""

import json
import re
from types import SimpleNamespace

import pytest
import torch

from blockspec.decoding.batch import batch_generate
from blockspec.decoding.grammar import Grammar
from blockspec.decoding.sequence import GenerationConfig
from blockspec.decoding.step import Draft, follow_grammar
from blockspec.drafters.dflash import DFlashDrafter
from blockspec.drafters.draft_lm import DraftModelDrafter
from blockspec.errors import BlockspecError
from blockspec.sampling import SamplingConfig, sampling_probs
from helpers import (
    PASS,
    NoisyOracle,
    chi_square_pvalue,
    decode,
    make_causal_lm,
    make_dflash,
    make_tokenizer,
    perturbed_copy,
)

VOCAB = 320
MAX_NEW = 40


@pytest.fixture(scope="module")
def world():
    tokenizer = make_tokenizer(VOCAB)
    target = make_causal_lm("qwen3", vocab_size=VOCAB, seed=4)
    return tokenizer, target, DFlashDrafter(make_dflash(target, block_size=8), target, sample_drafts=False)


def grammars(tokenizer) -> dict[str, tuple[Grammar, callable]]:
    """Each grammar with a check of the text it allows."""
    # a random tiny model would fill a schema's free whitespace forever: llguidance's option keeps it compact
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
              "required": ["a", "b"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    return {
        "regex": (Grammar.regex(tokenizer, "[0-9]{3}-[a-z]{2}"),
                  lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text)),
        "choice": (Grammar.choice(tokenizer, ["yes", "no", "maybe so"]),
                   lambda text: text in ("yes", "no", "maybe so")),
        "json": (Grammar.json_schema(tokenizer, schema),
                 lambda text: set(json.loads(text)) == {"a", "b"} and json.loads(text)["b"] in ("x", "yz")),
        "lark": (Grammar.lark(tokenizer, 'start: "(" NUM ("," NUM)* ")"\nNUM: /[1-9][0-9]?/'),
                 lambda text: re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", text)),
        "gbnf": (Grammar.lark(tokenizer, 'root ::= "a" ("b" | "c")+ "d"'), lambda text: re.fullmatch("a[bc]+d", text)),
    }


def texts(tokenizer):
    return [torch.tensor([tokenizer.encode(text)]) for text in ("hello there", "the answer is", "ab ab ab", "x")]


def config(tokenizer, grammar, **options):
    return GenerationConfig(max_new_tokens=MAX_NEW, grammar=grammar, stop_token_ids=(tokenizer.eos_token_id,),
                            **options)


@pytest.mark.parametrize("name", ["regex", "choice", "json", "lark", "gbnf"])
def test_constrained_output_follows_the_grammar(world, name):
    tokenizer, target, _ = world
    grammar, valid = grammars(tokenizer)[name]
    finished = 0
    for ids in texts(tokenizer):
        tokens = decode(target, ids, None, config(tokenizer, grammar)).token_ids
        if tokens[-1] == tokenizer.eos_token_id:
            finished += 1
            assert valid(tokenizer.decode(tokens[:-1])), tokenizer.decode(tokens)
        else:  # cut at the token limit: still a prefix the grammar allows
            assert grammar.start().matcher.try_consume_tokens(tokens) == len(tokens)
    assert finished >= 2


@pytest.mark.parametrize("name", ["regex", "choice", "json", "lark"])
def test_constrained_speculation_equals_constrained_plain_decoding(world, name):
    """Drafts right most of the time (a noisy oracle of the constrained answer, a near copy of the target), and
    drafts of the unconstrained answer, which the grammar refuses mid-block."""
    tokenizer, target, dflash = world
    grammar, _ = grammars(tokenizer)[name]
    draft_model = DraftModelDrafter(perturbed_copy(target), target, block_size=6)
    accepted = 0
    for ids in texts(tokenizer):
        plain = decode(target, ids, None, config(tokenizer, grammar)).token_ids
        free = decode(target, ids, None, GenerationConfig(max_new_tokens=MAX_NEW)).token_ids
        oracle = NoisyOracle(ids[0].tolist() + plain, VOCAB)
        astray = NoisyOracle(ids[0].tolist() + free, VOCAB, seed=1)
        for drafter, shape in [(dflash, {"block_size": 8}), (dflash, {"block_size": "auto", "tree_budget": 6}),
                               (oracle, {"block_size": 8}), (oracle, {"block_size": 8, "tree_budget": 6}),
                               (astray, {"block_size": 8}), (draft_model, {"block_size": 6})]:
            stream = decode(target, ids, drafter, config(tokenizer, grammar, **shape))
            assert stream.token_ids == plain, (name, drafter.name, shape)
            accepted += sum(stream.stats.accepted)
    assert accepted > 5


def test_constrained_rows_of_a_batch_equal_constrained_plain_decoding(world):
    tokenizer, target, dflash = world
    named = grammars(tokenizer)
    prompts = texts(tokenizer)
    chosen = [named[name][0] for name in ("regex", "choice", "json", "lark")]
    configs = [config(tokenizer, grammar, block_size=6) for grammar in chosen]
    plain = [decode(target, ids, None, config(tokenizer, grammar)).token_ids for ids, grammar in zip(prompts, chosen)]
    free = [GenerationConfig(max_new_tokens=MAX_NEW, block_size=6)]  # a row without a grammar beside them
    results = batch_generate(target, prompts + prompts[:1], dflash, configs + free, max_batch_size=5)
    assert [r.token_ids for r in results[:4]] == plain
    assert results[4].token_ids == decode(target, prompts[0], None, GenerationConfig(max_new_tokens=MAX_NEW)).token_ids


def a_draft(tokens, parents=None, probs=None):
    return Draft(root=5, position=3, tokens=list(tokens), parents=parents, probs=probs, confidences=[0.5] * len(tokens))


def constrained(grammar, output=()):
    sequence = SimpleNamespace(grammar=grammar.start())
    sequence.grammar.advance(list(output))
    return sequence


def test_drafts_are_the_tokens_the_grammar_forces_when_it_forces_some(world):
    tokenizer, _, _ = world
    word = tokenizer.encode("hello there the answer")
    sequence = constrained(Grammar.choice(tokenizer, ["hello there the answer"]))
    drafted = a_draft([7, 8, 9])
    follow_grammar(drafted, sequence)
    assert drafted.tokens == word[:3] and drafted.parents is None and drafted.confidences == [1.0] * 3


def test_drafts_the_grammar_refuses_are_dropped_with_what_hangs_under_them(world):
    tokenizer, _, _ = world
    one, two, letter = (tokenizer.convert_tokens_to_ids(t) for t in ("1", "2", "a"))
    grammar = Grammar.regex(tokenizer, "[0-9]{1,6}[a-z]?")
    chain = a_draft([one, two, letter, one])
    follow_grammar(chain, constrained(grammar, [one]))
    assert chain.tokens == [one, two, letter] and chain.confidences == [0.5] * 3
    # root 5; nodes: 0 "1", 1 "a" under 0, 2 "2" under 1 (refused: after a letter), 3 "a" under the root, 4 "2" under 3
    tree = a_draft([one, letter, two, letter, two], parents=[-1, 0, 1, -1, 3])
    follow_grammar(tree, constrained(grammar, [one]))
    assert tree.tokens == [one, letter, letter] and tree.parents == [-1, 0, -1]


def test_a_sampled_chain_is_never_cut_by_what_it_drew(world):
    tokenizer, _, _ = world
    one, letter = (tokenizer.convert_tokens_to_ids(t) for t in ("1", "a"))
    probs = torch.full((3, VOCAB), 1.0 / VOCAB)
    drafted = a_draft([one, letter, one], probs=probs)
    follow_grammar(drafted, constrained(Grammar.regex(tokenizer, "[0-9]{1,6}"), [one]))
    assert drafted.tokens == [one, letter, one] and drafted.probs is probs


def test_forced_tokens_are_drafted_and_accepted(world):
    tokenizer, target, dflash = world
    text = "the answer is hello there the answer is hello"
    grammar = Grammar.choice(tokenizer, [text])
    stream = decode(target, texts(tokenizer)[0], dflash, config(tokenizer, grammar, block_size=8))
    assert tokenizer.decode(stream.token_ids[:-1]) == text
    assert len(stream.stats.steps) <= len(stream.token_ids) // 3


@pytest.mark.parametrize("make,message", [
    (lambda tok: Grammar.regex(tok, "[0-9"), "the regex cannot be used to constrain the output"),
    (lambda tok: Grammar.json_schema(tok, "not json"), "the JSON schema is not valid JSON"),
    (lambda tok: Grammar.json_schema(tok, "[1, 2]"), "the JSON schema must be a JSON object, got list"),
    (lambda tok: Grammar.json_schema(tok, {"type": "no such type"}), "the JSON schema cannot be used"),
    (lambda tok: Grammar.lark(tok, "start: undefined_rule"), "the grammar cannot be used"),
    (lambda tok: Grammar.lark(tok, "root ::= ("), "GBNF grammar does not parse|the grammar cannot be used"),
    (lambda tok: Grammar.choice(tok, []), "a choice needs at least one option"),
])
def test_a_bad_grammar_is_refused_with_what_is_wrong(world, make, message):
    tokenizer, _, _ = world
    with pytest.raises(BlockspecError, match=message):
        make(tokenizer)


# --- sampling under a grammar: the exact distribution, enumerated over the paths it allows ---------------

def exact_constrained(target, grammar, sampling, prompt, length) -> dict:
    """P(output) of constrained plain sampling, over every path of ``length`` tokens the grammar allows."""
    state = grammar.start()
    joint = {}

    def walk(path, probability):
        if len(path) == length:
            joint[tuple(path)] = probability
            return
        with torch.no_grad():
            logits = target(torch.tensor([prompt + path])).logits[0, -1:]
        probs = sampling_probs(state.mask(logits.float(), [path]), sampling)[0]
        for token in torch.nonzero(probs).flatten().tolist():
            walk(path + [token], probability * float(probs[token]))

    walk([], 1.0)
    return joint


@pytest.mark.slow
def test_constrained_speculative_sampling_follows_constrained_target_sampling(world):
    tokenizer, target, _ = world
    grammar = Grammar.regex(tokenizer, "(ab|ba|a|b)(ab|b|c)(a|bc)[0-9]{20}")  # no end within the 3 tokens
    drafter = DFlashDrafter(make_dflash(target, block_size=4, seed=3), target)
    sampling = SamplingConfig(temperature=1.5)
    prompt = tokenizer.encode("hello there")
    probs = {k: v for k, v in exact_constrained(target, grammar, sampling, prompt, 3).items() if v > 0}
    samples = 2000
    counts = {}
    for seed in range(samples):
        stream = decode(target, torch.tensor([prompt]), drafter,
                        GenerationConfig(max_new_tokens=3, block_size=4, temperature=1.5, seed=seed, grammar=grammar))
        counts[tuple(stream.token_ids)] = counts.get(tuple(stream.token_ids), 0) + 1
    assert chi_square_pvalue(counts, probs, samples) > PASS
