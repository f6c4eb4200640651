"""Kubernetes' own rules for the names and labels a spec passes on into its children.

Each check returns the problem in words, or None. The CRD's schema cannot say all of this, and a
name the API server would refuse in a child must be refused in the spec instead: the operator
reports it as Valid=False naming the field, rather than failing on the child at every pass.
"""

from __future__ import annotations

import re

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
_DNS_LABEL = re.compile(rf"^{_LABEL}$")
_NAME_PART = re.compile(r"^[A-Za-z0-9]([-_.A-Za-z0-9]*[A-Za-z0-9])?$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


def dns_subdomain(value: str) -> str | None:
    if len(value) > 253 or not _DNS_SUBDOMAIN.match(value):
        return (
            f"{value!r} is not a DNS subdomain (lower-case letters, digits, '-' and '.', starting and "
            "ending with a letter or digit, at most 253 characters)"
        )
    return None


def dns_label(value: str) -> str | None:
    if len(value) > 63 or not _DNS_LABEL.match(value):
        return (
            f"{value!r} is not a DNS label (lower-case letters, digits and '-', starting and ending with a "
            "letter or digit, at most 63 characters)"
        )
    return None


def label_value(value: str) -> str | None:
    if value and (len(value) > 63 or not _NAME_PART.match(value)):
        return (
            f"{value!r} is not a label value (at most 63 letters, digits, '-', '_' or '.', starting and "
            "ending with a letter or digit)"
        )
    return None


def qualified_name(value: str) -> str | None:
    """A label or annotation key: an optional DNS-subdomain prefix and '/', then a name."""
    prefix, _, name = value.rpartition("/")
    if (prefix and dns_subdomain(prefix)) or len(name) > 63 or not _NAME_PART.match(name):
        return (
            f"{value!r} is not a label key (an optional DNS subdomain and '/', then at most 63 letters, "
            "digits, '-', '_' or '.')"
        )
    return None


def extended_resource(value: str) -> str | None:
    """A resource name for a device: domain-qualified, outside kubernetes.io."""
    domain = value.partition("/")[0]
    if (
        "/" not in value
        or qualified_name(value)
        or domain == "kubernetes.io"
        or domain.endswith(".kubernetes.io")
        or value.startswith("requests.")
    ):
        return (
            f"{value!r} is not an extended resource name (domain/name, outside kubernetes.io, such as nvidia.com/gpu)"
        )
    return None


def secret_key(value: str) -> str | None:
    if len(value) > 253 or not _SECRET_KEY.match(value):
        return f"{value!r} is not a Secret key (letters, digits, '-', '_' and '.')"
    return None


def env_name(value: str) -> str | None:
    if not _ENV_NAME.match(value):
        return (
            f"{value!r} is not an environment variable name (letters, digits, '-', '_' and '.', not "
            "starting with a digit)"
        )
    return None


def image(value: str) -> str | None:
    if value != value.strip() or not value:
        return f"{value!r} has leading or trailing whitespace"
    return None
