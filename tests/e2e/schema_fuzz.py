"""Schemathesis against a running gateway, from its own OpenAPI document: every phase (examples, coverage,
fuzzing, stateful over the document's links) and every check, with statuses counted. Used by
tests/e2e/test_gateway_fuzz.py; needs Python >= 3.11 (Schemathesis does)."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import schemathesis
from schemathesis.checks import CheckContext
from schemathesis.config import SchemathesisConfig
from schemathesis.core.failures import Failure
from schemathesis.engine import events, from_schema
from schemathesis.specs.openapi.checks import positive_data_acceptance

# A schema-valid body the gateway may still answer 400 only for these, each a rule no JSON schema can state: a
# limit of the running service (its vocabulary, --max-new-tokens, the model's context, the keys file's tenants)
# or a comparison of two fields. Anything else is a schema that promises more than the gateway serves.
RULES_BEYOND_THE_SCHEMA = (
    re.compile(r"outside the vocabulary"),  # token ids: /detokenize, stop_token_ids
    re.compile(r"max_new_tokens \d+ is over the server's limit"),  # the service's --max-new-tokens
    re.compile(r"^prompt has \d+ tokens|^the context holds"),  # prompt plus max_tokens over the context
    re.compile(r"min_tokens \(\d+\) is more than max_tokens"),  # two fields
    re.compile(r"min_tokens .* max_new_tokens"),  # the same, worded by the service
    re.compile(r"prompt must be empty or the segments joined"),  # two fields
    re.compile(r"is too small: the logits divided by it overflow"),  # the model's logits under a tiny temperature
    re.compile(r"^no tenant .* in the gateway's --keys-file"),  # the keys file's names
)


@schemathesis.check
def positive_data_acceptance_beyond_schema(ctx: CheckContext, response, case) -> bool | None:
    """Schemathesis's positive_data_acceptance, except a 400 whose message names one of RULES_BEYOND_THE_SCHEMA."""
    if response.status_code == 400 and case.meta is not None and case.meta.generation.mode.is_positive:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = ""
        if any(rule.search(message) for rule in RULES_BEYOND_THE_SCHEMA):
            return None
        raise Failure(operation=case.operation.label, title="Schema-valid request rejected",
                      message=f"400 for a rule the schema could state: {message[:300]} (phase "
                              f"{case.meta.phase.name})")
    return positive_data_acceptance(ctx, response, case)


@dataclass
class FuzzReport:
    statuses: Counter = field(default_factory=Counter)  # HTTP status -> responses
    phases: Counter = field(default_factory=Counter)  # Schemathesis phase -> responses
    failures: list[str] = field(default_factory=list)  # one line per distinct failed check
    server_errors: list[str] = field(default_factory=list)  # each response >= 500: the request and the answer
    errors: list[str] = field(default_factory=list)  # the engine's own errors (a request it could not send)

    @property
    def num_requests(self) -> int:
        return sum(self.statuses.values())

    def by_class(self) -> dict[str, int]:
        classes: Counter = Counter()
        for status, count in self.statuses.items():
            classes[f"{status // 100}xx"] += count
        return dict(sorted(classes.items()))

    def add(self, other: FuzzReport) -> None:
        self.statuses.update(other.statuses)
        self.phases.update(other.phases)
        self.failures += other.failures
        self.server_errors += other.server_errors
        self.errors += other.errors


def load_schema(base_url: str, api_key: str, max_examples: int, seed: int, max_steps: int = 8):
    """The gateway's document, configured for a run: all checks (positive_data_acceptance as above), positive and
    negative data, every phase."""
    config = SchemathesisConfig.from_dict({
        "seed": seed, "base-url": base_url, "headers": {"Authorization": f"Bearer {api_key}"},
        "request-timeout": 120, "workers": 1, "continue-on-failure": True, "suppress-health-check": ["all"],
        "generation": {"max-examples": max_examples, "mode": "all", "database": "none"},
        "checks": {"positive_data_acceptance": {"enabled": False}},
        "phases": {"stateful": {"max-steps": max_steps}},
        "output": {"sanitization": {"enabled": False}},  # the failure's curl shows the body as it was sent
    })
    return schemathesis.openapi.from_url(f"{base_url}/openapi.json", config=config,
                                         headers={"Authorization": f"Bearer {api_key}"})


def run(schema) -> FuzzReport:
    """Runs every phase against the schema's base URL; every response and failed check in the report."""
    report = FuzzReport()
    seen_failures: set[str] = set()
    for event in from_schema(schema).execute():
        if isinstance(event, (events.ScenarioFinished, events.FuzzScenarioFinished)):
            _record(event.recorder, report, seen_failures, str(getattr(event, "phase", "fuzz")))
        elif isinstance(event, events.NonFatalError):
            report.errors.append(f"{event.label}: {event.info.message}"[:500])
        elif isinstance(event, events.FatalError):
            raise event.exception
    return report


def _record(recorder, report: FuzzReport, seen_failures: set[str], phase: str) -> None:
    for interaction in recorder.interactions.values():
        if interaction.response is None:
            continue
        status = interaction.response.status_code
        report.statuses[status] += 1
        report.phases[phase] += 1
        if status >= 500:
            request = interaction.request
            body = (request.body or b"")[:300]
            report.server_errors.append(f"{request.method} {request.uri} {body!r} -> {status} "
                                        f"{interaction.response.content[:300]!r}")
    for checks in recorder.checks.values():
        for check in checks:
            if check.failure_info is None:
                continue
            failure = check.failure_info.failure
            line = f"{recorder.label}: {check.name}: {failure.title}: {failure.message}"[:600]
            key = f"{recorder.label}:{check.name}:{failure.message[:120]}"
            if key not in seen_failures:
                seen_failures.add(key)
                report.failures.append(line + f"\n    {check.failure_info.code_sample}"[:900])
