"""A violation of a JSON schema by a request's output, as checked mode reports it: keyword, places and value."""

from __future__ import annotations

from dataclasses import dataclass

NOT_JSON = "json"  # the keyword of a violation that is no keyword: the output is not JSON at all


@dataclass(frozen=True)
class Violation:
    """The output breaks ``keyword`` of the schema node at ``schema_pointer``: the value at ``instance_pointer``.

    ``checked_as``: the place the grammar left to the output check that covers this keyword ("if at /" for a
    ``then`` keyword); empty when none does, i.e. the grammar was meant to enforce it, which would be a bug of the
    policy, reported all the same.
    """

    keyword: str
    schema_pointer: str  # JSON pointer of the schema node that holds the keyword ("" is the root)
    instance_pointer: str  # JSON pointer of the offending value in the output ("" is the whole output)
    value: str  # the offending value as JSON, shortened
    reason: str  # the validator's words
    checked_as: str = ""

    @property
    def checked(self) -> bool:
        """Whether the keyword is one the grammar left to the check (the only kind checked mode should ever see)."""
        return bool(self.checked_as)

    def describe(self) -> str:
        """One line for the request's abort message."""
        own = self.checked_as == f"{self.keyword} at {self.schema_pointer or '/'}"
        what = (
            "meant to be enforced by the grammar"
            if not self.checked
            else "checked on the output" + ("" if own else f", as part of {self.checked_as}")
        )
        shown = "" if self.value in self.reason else f" {self.value}"  # jsonschema's words often quote it already
        return (
            f"the output violates {self.keyword} at {self.schema_pointer or '/'} of the JSON schema ({what}): "
            f"the value at {self.instance_pointer or '/'}{shown}: {self.reason}"
        )
