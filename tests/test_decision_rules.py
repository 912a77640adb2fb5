"""Prospective decision rules in campaign protocols: parsing (every refusal one clear line naming
the rule), the evaluator on hand-made metric tables (any_of / all_of, boundaries, min/max,
arithmetic, unknown values), the result lines, and end to end on a copy of the committed
cpu-quick campaign: analyze writes the verdicts, the report shows them, the audit re-evaluates
them and fails on each kind of tampering."""

from __future__ import annotations

import ast
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from test_campaign import (
    AUDIT_PY,
    ROOT,
    TINY,
    _edit_json,
    _rehash,
    audit_lines,
    write_protocol,
)

from cotangent.harness import audit
from cotangent.harness import analysis, campaign, report

RULE_ARMS = '["native", "cotangent", "batched-norms-only", "packing-only"]'  # the rules' arms

PRACTICAL = """
[[decision_rules]]
name = "practical"
kind = "practical"
description = "cotangent beats native by 0.003 BPB at <= 1.10x its time, or matches it faster"
any_of = [
  ["bpb(cotangent) <= bpb(native) - 0.003", "training_s(cotangent) <= 1.10 * training_s(native)",
   "peak_mib(cotangent) <= 1.25 * peak_mib(native)"],
  ["bpb(cotangent) <= bpb(native) + 0.001", "training_s(cotangent) <= 0.90 * training_s(native)"],
]
"""
MECHANISM = """
[[decision_rules]]
name = "mechanism"
kind = "mechanism"
all_of = ["update_s('packing-only') < update_s(native)",
          'min(update_s(cotangent), update_s("batched-norms-only")) < max(update_s(native), 1)']
"""


def _tiny_text() -> str:
    """test_campaign's tiny 4-arm protocol."""
    return TINY.format(arms=RULE_ARMS, seeds="[0, 1]", design="latin")


def parse(rules: str) -> campaign.Protocol:
    """The tiny 4-arm protocol with `rules` appended."""
    return campaign.parse_protocol(_tiny_text() + rules, "p.toml")


# ---------------------------------------------------------------- parsing

def test_a_protocol_without_rules_has_none():
    assert parse("").decision_rules == ()


@pytest.mark.parametrize("rules, expected", [
    (PRACTICAL, [{
        "name": "practical", "kind": "practical",
        "description": "cotangent beats native by 0.003 BPB at <= 1.10x its time, or matches "
                       "it faster",
        "any_of": [["bpb(cotangent) <= bpb(native) - 0.003",
                    "training_s(cotangent) <= 1.10 * training_s(native)",
                    "peak_mib(cotangent) <= 1.25 * peak_mib(native)"],
                   ["bpb(cotangent) <= bpb(native) + 0.001",
                    "training_s(cotangent) <= 0.90 * training_s(native)"]]}]),
    # all_of is one clause; kind and description default to ""; quoted arms both ways
    (MECHANISM.replace('kind = "mechanism"\n', ""), [{
        "name": "mechanism", "kind": "", "description": "",
        "any_of": [["update_s('packing-only') < update_s(native)",
                    'min(update_s(cotangent), update_s("batched-norms-only")) < '
                    'max(update_s(native), 1)']]}]),
    # unary minus, parentheses, division, integers, >= and >, whitespace around
    ('[[decision_rules]]\nname = "a-1_B"\nall_of = [" -(bpb(native) - 2) / 4 >= -1 ", '
     '"peak_mib(\'packing-only\') > 0"]\n', [{
         "name": "a-1_B", "kind": "", "description": "",
         "any_of": [[" -(bpb(native) - 2) / 4 >= -1 ", "peak_mib('packing-only') > 0"]]}]),
])
def test_valid_rules_are_normalised(rules, expected):
    assert [dict(r) for r in parse(rules).decision_rules] == expected


def _rule(body: str, name: str = "r") -> str:
    return f'[[decision_rules]]\nname = "{name}"\n{body}\n'


@pytest.mark.parametrize("rules, message", [
    # unknown metric, arm, function; a '-' arm written bare
    (_rule('all_of = ["loss(native) <= 1"]'),
     "decision rule 'r', clause 1: unknown metric 'loss' in 'loss(native) <= 1' (metrics: bpb,"),
    (_rule('all_of = ["bpb(adam) <= 1"]'), "decision rule 'r', clause 1: unknown arm 'adam'"),
    (_rule("all_of = [\"bpb('cotangent-zero1') <= 1\"]"),
     "unknown arm 'cotangent-zero1' in \"bpb('cotangent-zero1') <= 1\" (the protocol's arms: "
     "native, cotangent, batched-norms-only, packing-only)"),
    (_rule('all_of = ["bpb(packing-only) <= 1"]'),
     "a metric takes one arm, a bare name or a quoted string"),
    (_rule('all_of = ["bpb(native, cotangent) <= 1"]'), "a metric takes one arm"),
    (_rule('all_of = ["bpb(arm=native) <= 1"]'), "a metric takes one arm"),
    (_rule('all_of = ["bpb(1) <= 1"]'), "a metric takes one arm"),
    (_rule('all_of = ["abs(bpb(native)) <= 1"]'), "unknown metric 'abs'"),
    (_rule('all_of = ["min() <= 1"]'), "min takes one or more expressions"),
    (_rule('all_of = ["max(*[1]) <= 1"]'), "max takes one or more expressions"),
    # syntax and the shape of a condition
    (_rule('all_of = ["bpb(native) <="]'), "clause 1: 'bpb(native) <=' is not a valid expression"),
    (_rule('all_of = ["bpb(native) - 1"]'), "is not a comparison"),
    (_rule('all_of = ["1 < bpb(native) < 2"]'), "chains comparisons"),
    (_rule('all_of = ["bpb(native) == 3"]'), "compare with <=, <, >= or > only"),
    (_rule('all_of = ["bpb(native) != 3"]'), "compare with <=, <, >= or > only"),
    (_rule('all_of = ["bpb(native) <= 1", "1 <= 2 <= 3"]'), "clause 1: '1 <= 2 <= 3' chains"),
    (_rule('all_of = ["bpb(native) <= 1 and 2 <= 3"]'), "is not a comparison"),
    # disallowed nodes
    (_rule('all_of = ["bpb(native) ** 2 <= 1"]'), "only numbers, + - * /"),
    (_rule('all_of = ["bpb(native) % 2 <= 1"]'), "only numbers, + - * /"),
    (_rule('all_of = ["~1 <= 1"]'), "only numbers, + - * /"),
    (_rule("all_of = [\"__import__('os') <= 1\"]"), "unknown metric '__import__'"),
    (_rule("all_of = [\"__import__('os').system('true') <= 1\"]"), "only numbers, + - * /"),
    (_rule("all_of = [\"().__class__ <= 1\"]"), "only numbers, + - * /"),
    (_rule('all_of = ["(lambda: 1)() <= 1"]'), "only numbers, + - * /"),
    (_rule('all_of = ["[1][0] <= 1"]'), "only numbers, + - * /"),
    (_rule('all_of = ["(x := 1) <= 1"]'), "only numbers, + - * /"),
    (_rule('all_of = ["x <= 1"]'), "bare name 'x' in 'x <= 1'"),
    (_rule("all_of = [\"'a' <= 'b'\"]"), "'a' in \"'a' <= 'b'\" is not a number"),
    (_rule('all_of = ["True <= 1"]'), "True in 'True <= 1' is not a number"),
    (_rule('all_of = ["1e999 <= bpb(native)"]'), "is not a finite number"),
    (_rule(f'all_of = ["1{"0" * 400} <= bpb(native)"]'), "is not a finite number"),
    (_rule('all_of = ["1j <= 1"]'), "is not a number"),
    (_rule(f'all_of = ["{"(" * 300}1{")" * 300} <= 1"]'), "is not a valid expression"),
    (_rule(f'all_of = ["{"1 + " * 400}1 <= 1"]'), "a condition of 1606 characters (at most 1000)"),
    # the rule's structure
    (_rule('all_of = [""]'), "clause 1: a condition must be a non-empty string, got ''"),
    (_rule("all_of = [3]"), "clause 1: a condition must be a non-empty string, got 3"),
    (_rule("all_of = []"), "decision rule 'r': clause 1 is empty"),
    (_rule("any_of = [[]]"), "decision rule 'r': clause 1 is empty"),
    (_rule('any_of = [["bpb(native) <= 4"], []]'), "decision rule 'r': clause 2 is empty"),
    (_rule("any_of = []"), "decision rule 'r': any_of must be a non-empty list of clauses"),
    (_rule('any_of = ["bpb(native) <= 4"]'), "clause 1 is a string, not a list of conditions"),
    (_rule('any_of = [["bpb(native) <= 4"]]\nall_of = ["bpb(native) <= 4"]'),
     "decision rule 'r': give exactly one of any_of"),
    (_rule('kind = "x"'), "decision rule 'r': give exactly one of any_of"),
    (_rule('all_of = ["bpb(native) <= 4"]\nthreshold = 3'),
     "decision rule 'r': unknown key(s) threshold; known: name, kind, description"),
    (_rule('all_of = ["bpb(native) <= 4"]\nkind = 3'), "decision rule 'r': kind must be a string"),
    (_rule('all_of = ["bpb(native) <= 4"]\ndescription = ["x"]'),
     "decision rule 'r': description must be a string"),
    (_rule('all_of = ["bpb(native) <= 4"]') * 2, "decision rule 'r': duplicate name"),
    (_rule('all_of = ["bpb(native) <= 4"]', name="a b"),
     "decision_rules[0]: name must be letters, digits, '_' or '-', got 'a b'"),
    ('[[decision_rules]]\nall_of = ["bpb(native) <= 4"]\n', "decision_rules[0]: name must be"),
    (_rule('all_of = ["bpb(native) <= 4"]') + '[[decision_rules]]\nname = ""\n',
     "decision_rules[1]: name must be"),
    ('[decision_rules]\nname = "r"\n', "decision_rules must be an array of tables"),
])
def test_invalid_rules_are_one_clear_line(rules, message):
    with pytest.raises(ValueError) as info:
        parse(rules)
    text = str(info.value)
    assert text.startswith("p.toml: ") and "\n" not in text
    assert message in text, text


def test_decision_rules_may_not_hide_in_train():
    with pytest.raises(ValueError, match=r"\[train\] unknown setting\(s\) decision_rules"):
        campaign.parse_protocol(_tiny_text() + "decision_rules = []\n", "p.toml")


def test_freeze_names_the_frozen_rules(tmp_path):
    path = write_protocol(tmp_path, arms=RULE_ARMS)
    path.write_text(path.read_text() + PRACTICAL + MECHANISM)
    lines = []
    camp = campaign.freeze(str(path), str(tmp_path / "c"), None, log=lines.append)
    assert "decision rules, frozen with the protocol: practical, mechanism" in lines
    # the rules are part of the hashed protocol bytes
    assert "any_of" in (camp / "protocol.toml").read_text()
    frozen = json.loads((camp / "freeze.json").read_text())
    assert frozen["protocol_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    protocol, _ = campaign.load_frozen(camp)
    assert [r["name"] for r in protocol.decision_rules] == ["practical", "mechanism"]


def test_the_evaluator_never_calls_eval():
    tree = ast.parse(AUDIT_PY.read_text())
    called = {node.func.id for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert not called & {"eval", "exec", "compile", "__import__"}


# ---------------------------------------------------------------- evaluation

ARMS = ("U", "AP", "other-arm")


def table(**arms) -> dict:
    """A metrics table {arm: {seeds, bpb, training_s, update_s, peak_mib}} from keyword rows;
    an arm not given has no done run."""
    out = {}
    for arm in ARMS:
        values = arms.get(arm.replace("-", "_"))
        out[arm] = ({"seeds": [], "bpb": None, "training_s": None, "update_s": None,
                     "peak_mib": None} if values is None else
                    {"seeds": [0, 1], **dict(zip(("bpb", "training_s", "update_s", "peak_mib"),
                                                 values))})
    return out


def rule(*clauses) -> dict:
    return audit.check_decision_rules([{"name": "r", "any_of": [list(c) for c in clauses]}],
                                      ARMS)[0]


BASE = table(U=(3.5, 10.0, 1.0, 400.0), AP=(3.496, 10.5, 0.5, 480.0),
             other_arm=(4.0, 8.0, 0.25, 100.0))
PRACTICAL_RULE = rule(
    ["bpb(AP) <= bpb(U) - 0.003", "training_s(AP) <= 1.10 * training_s(U)",
     "peak_mib(AP) <= 1.25 * peak_mib(U)"],
    ["bpb(AP) <= bpb(U) + 0.001", "training_s(AP) <= 0.90 * training_s(U)"])


@pytest.mark.parametrize("metrics, clauses, verdict", [
    # clause 1: every condition holds (3.496 <= 3.497, 10.5 <= 11, 480 <= 500)
    (BASE, [True, False], "pass"),
    # memory over 1.25x: clause 1 fails; clause 2 fails on time
    (table(U=(3.5, 10.0, 1.0, 400.0), AP=(3.496, 10.5, 0.5, 501.0)), [False, False], "fail"),
    # no quality gain, but 0.90x the time: clause 2 alone passes the rule
    (table(U=(3.5, 10.0, 1.0, 400.0), AP=(3.5005, 9.0, 0.5, 900.0)), [False, True], "pass"),
    # quality lost by more than 0.001: both fail
    (table(U=(3.5, 10.0, 1.0, 400.0), AP=(3.502, 5.0, 0.5, 100.0)), [False, False], "fail"),
    # U has no done run: nothing can be computed
    (table(AP=(3.496, 10.5, 0.5, 480.0)), [None, None], "undecided"),
    # AP's memory unknown: clause 1 undecided, clause 2 fails on time -> undecided
    (table(U=(3.5, 10.0, 1.0, 400.0), AP=(3.496, 10.5, 0.5, None)), [None, False], "undecided"),
    # AP's memory unknown but clause 2 holds: the unknown value cannot change the verdict
    (table(U=(3.5, 10.0, 1.0, 400.0), AP=(3.496, 8.0, 0.5, None)), [None, True], "pass"),
    # AP's memory unknown, but clause 1 already fails on BPB: a failed condition decides it
    (table(U=(3.5, 10.0, 1.0, 400.0), AP=(3.6, 10.5, 0.5, None)), [False, False], "fail"),
])
def test_any_of_all_of_and_unknown_values(metrics, clauses, verdict):
    result = audit.evaluate_rule(PRACTICAL_RULE, metrics)
    assert [c["held"] for c in result["clauses"]] == clauses
    assert result["verdict"] == verdict


def test_each_condition_records_its_sides_values_and_outcome():
    result = audit.evaluate_rule(PRACTICAL_RULE, BASE)
    first = result["clauses"][0]["conditions"]
    assert [(c["left_expression"], c["op"], c["right_expression"]) for c in first] == [
        ("bpb(AP)", "<=", "bpb(U) - 0.003"),
        ("training_s(AP)", "<=", "1.10 * training_s(U)"),
        ("peak_mib(AP)", "<=", "1.25 * peak_mib(U)")]
    assert [c["left"] for c in first] == [3.496, 10.5, 480.0]
    assert [c["right"] for c in first] == pytest.approx([3.497, 11.0, 500.0], rel=1e-15)
    assert [c["held"] for c in first] == [True, True, True]
    second = result["clauses"][1]["conditions"]
    assert [c["held"] for c in second] == [True, False]
    assert second[1]["right"] == pytest.approx(9.0, rel=1e-15)
    assert "unknown" not in first[0]


def test_an_unknown_value_says_why():
    metrics = table(U=(3.5, 10.0, 1.0, 400.0), AP=(3.496, 10.5, 0.5, None))
    result = audit.evaluate_rule(PRACTICAL_RULE, metrics)
    memory = result["clauses"][0]["conditions"][2]
    assert memory["left"] is None and memory["right"] == 500.0 and memory["held"] is None
    assert memory["unknown"] == "peak_mib(AP): a run of AP lacks the record"
    missing = audit.evaluate_rule(PRACTICAL_RULE, table(AP=(3.496, 10.5, 0.5, 480.0)))
    assert missing["clauses"][0]["conditions"][0]["unknown"] == "bpb(U): no done run of U"


@pytest.mark.parametrize("condition, left, right, held", [
    ("bpb(U) <= 3.5", 3.5, 3.5, True),            # boundaries: <= and >= include equality
    ("bpb(U) < 3.5", 3.5, 3.5, False),
    ("bpb(U) >= 3.5", 3.5, 3.5, True),
    ("bpb(U) > 3.5", 3.5, 3.5, False),
    ("min(bpb(U), bpb(AP), 3.4) <= 3.4", 3.4, 3.4, True),
    ("max(update_s(U), update_s(AP)) > 0.75", 1.0, 0.75, True),
    ("max(1) >= min(2)", 1.0, 2.0, False),
    # precedence: * and / before + and -, unary minus, parentheses
    ("1 + 2 * 3 - 8 / 4 >= 5", 5.0, 5.0, True),
    ("-(training_s(U) - 2 * training_s(AP)) / 2 > 5.5", 5.5, 5.5, False),
    ("- -training_s(U) < +11", 10.0, 11.0, True),
    ("training_s('other-arm') / training_s(U) <= 0.8", 0.8, 0.8, True),
    ('peak_mib("other-arm") * 4 <= peak_mib(U)', 400.0, 400.0, True),
])
def test_arithmetic_min_max_and_boundaries(condition, left, right, held):
    c = audit.evaluate_rule(rule([condition]), BASE)["clauses"][0]["conditions"][0]
    assert (c["left"], c["right"], c["held"]) == (left, right, held)


def test_division_by_zero_is_unknown_not_a_crash():
    metrics = table(U=(3.5, 0.0, 1.0, 400.0), AP=(3.4, 1.0, 1.0, 400.0))
    result = audit.evaluate_rule(rule(["training_s(AP) / training_s(U) <= 2"],
                                      ["bpb(AP) <= 3"]), metrics)
    c = result["clauses"][0]["conditions"][0]
    assert c["held"] is None and "division by zero" in c["unknown"]
    assert result["verdict"] == "undecided"  # clause 2 fails, clause 1 is unknown
    huge = audit.evaluate_rule(rule(["1e308 * 10 <= bpb(AP)"]), metrics)
    assert huge["verdict"] == "undecided" and "not finite" in huge["clauses"][0]["conditions"][
        0]["unknown"]


def _runs(*rows) -> list[dict]:
    return [{"seed": s, "test_bpb": b, "training_s": t, "update_s": u, "peak_rss_kib": p}
            for s, b, t, u, p in rows]


def test_metrics_are_means_and_medians_over_the_seeds():
    runs = _runs((0, 3.0, 10.0, 1.0, 1024), (1, 3.3, 30.0, 2.0, 4096), (2, 3.6, 11.0, 9.0, 2048))
    m = audit.decision_metrics(runs)
    assert m == {"seeds": [0, 1, 2], "bpb": pytest.approx(3.3, rel=1e-15), "training_s": 11.0,
                 "update_s": 2.0, "peak_mib": 2.0}
    even = audit.decision_metrics(runs[:2])  # an even count: the median is the midpoint
    assert (even["training_s"], even["update_s"], even["peak_mib"]) == (20.0, 1.5, 2.5)
    assert audit.decision_metrics([]) == {"seeds": [], "bpb": None, "training_s": None,
                                          "update_s": None, "peak_mib": None}
    older = runs[:2] + [{**runs[2], "peak_rss_kib": None}]
    assert audit.decision_metrics(older)["peak_mib"] is None
    assert audit.decision_metrics(older)["bpb"] == m["bpb"]
    assert audit.decision_metrics([{**runs[0], "test_bpb": True}])["bpb"] is None


def test_verdicts_per_model_with_the_metrics_each_rule_reads():
    done = {}
    for model, shift in (("m1", 0.0), ("m2", 1.0)):
        for seed in (0, 1):
            for arm, bpb in (("U", 3.5), ("AP", 3.4)):
                done[(model, seed, arm)] = _runs((seed, bpb + shift * (arm == "AP"), 10.0,
                                                  1.0, 1024))[0]
    del done[("m2", 1, "U")]  # a failed job: U of m2 has seed 0 only
    rules = [rule(["bpb(AP) <= bpb(U)"]), {**rule(["update_s(U) > 0"]), "name": "s"}]
    out = audit.decision_rule_verdicts(rules, ["m1", "m2"], list(ARMS), [0, 1], done)
    assert [(v["model"], v["name"], v["verdict"]) for v in out] == [
        ("m1", "r", "pass"), ("m1", "s", "pass"), ("m2", "r", "fail"), ("m2", "s", "pass")]
    assert out[0]["metrics"] == {"U": {"seeds": [0, 1], "bpb": 3.5},
                                 "AP": {"seeds": [0, 1], "bpb": 3.4}}
    assert out[3]["metrics"] == {"U": {"seeds": [0], "update_s": 1.0}}
    line = analysis.decision_rule_line(out[2], [0, 1])
    assert line == ("FAIL r (m2): clause 1 fails: bpb(AP)=4.4 <= bpb(U)=3.5 (NO) "
                    "[done seeds: U 1 of 2]")


def test_result_lines_show_the_numbers_that_decided():
    result = audit.evaluate_rule(PRACTICAL_RULE, BASE)
    entry = {"model": "tiny", "name": "practical", "kind": "practical", **result,
             "metrics": {}}
    assert analysis.decision_rule_line(entry) == (
        "PASS practical [practical] (tiny): clause 1 holds: bpb(AP)=3.496 <= "
        "bpb(U) - 0.003=3.497 (yes) and training_s(AP)=10.5 <= 1.10 * training_s(U)=11 (yes) "
        "and peak_mib(AP)=480 <= 1.25 * peak_mib(U)=500 (yes); clause 2 fails: bpb(AP)=3.496 "
        "<= bpb(U) + 0.001=3.501 (yes) and training_s(AP)=10.5 <= 0.90 * training_s(U)=9 (NO)")
    # two sides equal to 6 digits are shown with enough digits to differ
    close = audit.evaluate_rule(rule(["bpb(AP) <= bpb(U)"]),
                                table(U=(3.4000001, 1, 1, 1), AP=(3.4000002, 1, 1, 1)))
    text = analysis.decision_rule_line({"model": "m", "name": "r", "kind": "", **close,
                                        "metrics": {}})
    assert "bpb(AP)=3.4000002 <= bpb(U)=3.4000001 (NO)" in text
    unknown = audit.evaluate_rule(PRACTICAL_RULE, table(AP=(3.4, 1, 1, 1)))
    text = analysis.decision_rule_line({"model": "m", "name": "r", "kind": "", **unknown,
                                        "metrics": {}})
    assert text.startswith("UNDECIDED r (m): clause 1 undecided: bpb(AP)=3.4 <= "
                           "bpb(U) - 0.003=? (unknown: bpb(U): no done run of U)")


# ---------------------------------------------------------------- end to end

def _with_rules(src: Path, dst: Path, rules: str, top: str = "") -> Path:
    """A copy of a finished campaign whose protocol.toml gained `rules` at its end (and `top`
    at its start), re-frozen (its SHA-256 in freeze.json), as if frozen so before its runs,
    and analysed."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("report", ".lock"))
    (dst / "protocol.toml").write_text(top + (dst / "protocol.toml").read_text() + rules)
    frozen = json.loads((dst / "freeze.json").read_text())
    frozen["protocol_sha256"] = hashlib.sha256((dst / "protocol.toml").read_bytes()).hexdigest()
    (dst / "freeze.json").write_text(json.dumps(frozen, indent=2, sort_keys=True) + "\n")
    analysis.analyze(dst, log=lambda *_: None)
    return dst


COMMITTED = ROOT / "results" / "cpu-quick"


@pytest.fixture(scope="module")
def ruled(tmp_path_factory) -> Path:
    """The committed cpu-quick campaign (4 arms x 8 seeds) with two rules, analysed and
    reported."""
    camp = _with_rules(COMMITTED, tmp_path_factory.mktemp("ruled") / "c", PRACTICAL + MECHANISM)
    report.build_report(camp, log=lambda *_: None)
    return camp


def _summaries(camp: Path) -> dict[str, list[dict]]:
    """Each arm's summary.json records, read directly."""
    out: dict[str, list[dict]] = {}
    for path in sorted(camp.glob("jobs/*/attempt-*/*/*/summary.json")):
        out.setdefault(path.parent.name, []).append(json.loads(path.read_text()))
    return out


def test_analyze_writes_the_verdicts_from_the_run_records(ruled):
    results = json.loads((ruled / "analysis" / "results.json").read_text())
    rules = results["decision_rules"]
    assert "decision rule, not a significance test" in rules["note"]
    assert "before any run" in rules["note"] and "prospective" in rules["note"]
    assert [r["name"] for r in rules["rules"]] == ["practical", "mechanism"]
    assert [(v["model"], v["name"]) for v in rules["verdicts"]] == [
        ("transformer-quick", "practical"), ("transformer-quick", "mechanism")]
    runs = _summaries(ruled)
    assert sorted(runs) == sorted(results["protocol"]["arms"]) and all(
        len(r) == 8 for r in runs.values())
    practical, mechanism = rules["verdicts"]
    for arm, metrics in practical["metrics"].items():
        assert metrics["seeds"] == list(range(8))
        assert metrics["bpb"] == statistics.fmean(r["test_bpb"] for r in runs[arm])
        assert metrics["training_s"] == statistics.median(r["training_s"] for r in runs[arm])
        assert metrics["peak_mib"] == statistics.median(r["peak_rss_kib"] / 1024
                                                        for r in runs[arm])
    native, cot = practical["metrics"]["native"], practical["metrics"]["cotangent"]
    # bitwise-identical arms: equal BPB, so "beats by 0.003" fails and "within 0.001" holds
    assert cot["bpb"] == native["bpb"]
    c1, c2 = (c["conditions"] for c in practical["clauses"])
    assert c1[0]["held"] is False and c2[0]["held"] is True
    assert c2[1]["held"] == (cot["training_s"] <= 0.90 * native["training_s"])
    assert practical["verdict"] == ("pass" if c2[1]["held"] else "fail")
    update = {arm: statistics.median(r["update_s"] for r in runs[arm]) for arm in runs}
    expect = (update["packing-only"] < update["native"] and min(
        update["cotangent"], update["batched-norms-only"]) < max(update["native"], 1))
    assert mechanism["verdict"] == ("pass" if expect else "fail")
    assert sorted(mechanism["metrics"]) == sorted(runs)
    assert all(sorted(m) == ["seeds", "update_s"] for m in mechanism["metrics"].values())
    text = analysis.format_results(results)
    assert "decision rules (prospective, fixed before any run; decision rules, not " \
           "significance tests):" in text
    assert f"  {practical['verdict'].upper()} practical [practical] (transformer-quick): " \
           "clause 1 fails: bpb(cotangent)=" in text
    assert f"  {mechanism['verdict'].upper()} mechanism [mechanism] (transformer-quick)" in text


def test_the_report_shows_each_rule_with_its_numbers(ruled):
    md = (ruled / "report" / "report.md").read_text()
    html = (ruled / "report" / "report.html").read_text()
    assert "## Decision rules (prospective, not significance tests)" in md
    assert "decision rule, not a significance test" in md
    assert "practical [practical] (transformer-quick): clause 1 fails: `bpb(cotangent)`=" in md
    assert "Declared as: cotangent beats native by 0.003 BPB" in md
    assert "<code>bpb(native) - 0.003</code>=" in html


def test_the_audit_re_evaluates_the_rules_clean(ruled):
    rc, failures = audit_lines(ruled)
    assert rc == 0, failures
    # the bare interpreter (standard library only) evaluates them too
    proc = subprocess.run([sys.executable, "-I", "-S", str(AUDIT_PY), str(ruled)],
                          capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stdout + proc.stderr


def _flip(verdict: str) -> str:
    return "fail" if verdict == "pass" else "pass"


@pytest.mark.parametrize("kind, expect", [
    ("verdict", "decision_rules.verdicts[transformer-quick, practical].verdict"),
    ("clause", "decision_rules.verdicts[transformer-quick, practical].clauses[0].held"),
    ("value", "decision_rules.verdicts[transformer-quick, practical].clauses[1].conditions[1]"
              ".right"),
    ("metric", "decision_rules.verdicts[transformer-quick, mechanism].metrics.native.update_s"),
    ("seeds", "decision_rules.verdicts[transformer-quick, mechanism].metrics.native.seeds"),
    ("dropped", "decision_rules.verdicts: not one entry per model and rule"),
    ("rules", "decision_rules.rules are not protocol.toml's"),
    ("note", "decision_rules.note is not the statement"),
    ("removed", "no decision_rules, but protocol.toml declares them"),
])
def test_the_audit_fails_on_tampered_decision_rules(ruled, tmp_path, kind, expect):
    camp = tmp_path / "c"
    shutil.copytree(ruled, camp)

    def edit(results: dict) -> None:
        rules = results["decision_rules"]
        practical, mechanism = rules["verdicts"]
        if kind == "verdict":
            practical["verdict"] = _flip(practical["verdict"])
        elif kind == "clause":
            practical["clauses"][0]["held"] = True
        elif kind == "value":
            practical["clauses"][1]["conditions"][1]["right"] *= 1.01
        elif kind == "metric":
            mechanism["metrics"]["native"]["update_s"] /= 2
        elif kind == "seeds":
            mechanism["metrics"]["native"]["seeds"] = [0, 1]
        elif kind == "dropped":
            rules["verdicts"] = [practical]
        elif kind == "rules":
            rules["rules"][0]["any_of"][0][0] = "bpb(cotangent) <= bpb(native) + 0.003"
        elif kind == "note":
            rules["note"] = "significant at p < 0.05"
        elif kind == "removed":
            del results["decision_rules"]

    _edit_json(camp, "analysis/results.json", edit)
    shutil.rmtree(camp / "report")  # not stale-report failures: the rules' own checks
    rc, failures = audit_lines(camp)
    assert rc == 1 and any(f.startswith("analysis/results.json") and expect in f
                           for f in failures), failures


def test_the_audit_re_evaluates_from_the_records_not_from_results(ruled, tmp_path):
    """A run record edited consistently (manifest rehashed): the recomputed metric moves, so the
    recorded verdict's numbers no longer agree."""
    camp = tmp_path / "c"
    shutil.copytree(ruled, camp, ignore=shutil.ignore_patterns("report"))
    summaries = sorted(camp.glob("jobs/*/attempt-*/*/native/summary.json"))
    assert len(summaries) == 8
    for summary in summaries:  # every native run, so that the median moves
        _edit_json(camp, summary.relative_to(camp).as_posix(),
                   lambda s: s.update(peak_rss_kib=s["peak_rss_kib"] * 10))
    rc, failures = audit_lines(camp)
    assert rc == 1 and any("decision_rules.verdicts[transformer-quick, practical].metrics."
                           "native.peak_mib" in f for f in failures), failures


def test_rules_claimed_without_rules_in_the_protocol_fail_the_audit(ruled, tmp_path):
    camp = tmp_path / "c"
    shutil.copytree(COMMITTED, camp, ignore=shutil.ignore_patterns("report"))
    analysis.analyze(camp, log=lambda *_: None)
    results = json.loads((camp / "analysis" / "results.json").read_text())
    assert "decision_rules" not in results  # no rules: results as before
    assert "decision rules" not in analysis.format_results(results)
    assert audit_lines(camp) == (0, [])
    forged = json.loads((ruled / "analysis" / "results.json").read_text())["decision_rules"]
    _edit_json(camp, "analysis/results.json", lambda r: r.update(decision_rules=forged))
    rc, failures = audit_lines(camp)
    assert rc == 1 and any("decision_rules recorded, but protocol.toml declares none" in f
                           for f in failures), failures


def test_an_empty_rule_list_is_no_rules(tmp_path):
    assert parse("").decision_rules == campaign.parse_protocol(
        "decision_rules = []\n" + _tiny_text(), "p.toml").decision_rules == ()
    camp = _with_rules(COMMITTED, tmp_path / "c", "", top="decision_rules = []\n")
    assert "decision_rules = []" in (camp / "protocol.toml").read_text()
    assert "decision_rules" not in json.loads((camp / "analysis" / "results.json").read_text())
    assert audit_lines(camp) == (0, [])


def test_an_invalid_rule_in_a_forged_protocol_fails_the_audit(ruled, tmp_path):
    camp = tmp_path / "c"
    shutil.copytree(ruled, camp, ignore=shutil.ignore_patterns("report"))
    text = (camp / "protocol.toml").read_text().replace("bpb(native) - 0.003",
                                                        "bpb(native) ** 0.003")
    (camp / "protocol.toml").write_text(text)
    _rehash(camp, "protocol.toml")
    rc, failures = audit_lines(camp)
    assert rc == 1 and any(f.startswith("protocol.toml: decision rule 'practical', clause 1: ")
                           for f in failures), failures
