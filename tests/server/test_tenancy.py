"""Tenant isolation: with API keys, a tenant never hits another tenant's cached prefix."""

from __future__ import annotations

import uuid

import openai
import pytest

from radixkv.server.errors import APIError
from radixkv.server.tenancy import Tenancy
from tests.server.conftest import KEY_A, KEY_B, ServerProcess


def cached_tokens(client: openai.OpenAI, model: str, prompt: str, salt: str | None = None) -> int:
    result = client.completions.create(
        model=model, prompt=prompt, max_tokens=1, temperature=0,
        extra_body={"cache_salt": salt} if salt is not None else None,
    )
    assert result.usage is not None and result.usage.prompt_tokens_details is not None
    cached = result.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return cached


# Token-granular hits: a fresh prompt may still share its first token or two with an earlier
# prompt of the same tenant (the uuid's first hex digits), so "nothing cached" allows that.
COINCIDENTAL = 2


def long_prompt() -> str:
    """About 80 tokens nobody has sent before."""
    return f"{uuid.uuid4().hex} " + "The quick brown fox jumps over the lazy dog. " * 6


def test_two_keys_do_not_share_cache_hits(tiny_server: ServerProcess, model_name: str) -> None:
    alpha, bravo = tiny_server.client(KEY_A), tiny_server.client(KEY_B)
    prompt = long_prompt()
    assert cached_tokens(alpha, model_name, prompt) <= COINCIDENTAL
    hit = cached_tokens(alpha, model_name, prompt)
    assert hit > 32  # the tenant's own second request is served from the cache
    assert cached_tokens(bravo, model_name, prompt) <= COINCIDENTAL  # the other tenant computes it
    assert cached_tokens(bravo, model_name, prompt) == hit
    assert cached_tokens(alpha, model_name, prompt) == hit


def test_client_salt_subdivides_a_tenant(tiny_server: ServerProcess, model_name: str) -> None:
    alpha, bravo = tiny_server.client(KEY_A), tiny_server.client(KEY_B)
    prompt = long_prompt()
    assert cached_tokens(alpha, model_name, prompt, salt="team-1") <= COINCIDENTAL
    assert cached_tokens(alpha, model_name, prompt, salt="team-1") > 0
    assert cached_tokens(alpha, model_name, prompt, salt="team-2") <= COINCIDENTAL
    assert cached_tokens(alpha, model_name, prompt) <= COINCIDENTAL  # no salt is a subdivision too
    # The same client salt under another key is another tenant's subdivision.
    assert cached_tokens(bravo, model_name, prompt, salt="team-1") <= COINCIDENTAL


def test_salt_is_derived_from_the_key_not_the_key() -> None:
    tenancy = Tenancy(["k1", "k2"], secret=b"s" * 32)
    one = tenancy.tenant("Bearer k1")
    assert one is not None and "k1" not in one
    assert tenancy.tenant("bearer  k1 ") == one
    assert tenancy.tenant("Bearer k2") not in (None, one)
    assert Tenancy(["k1"], secret=b"t" * 32).tenant("Bearer k1") != one  # keyed by the secret
    assert Tenancy.cache_salt(one, None) == one
    assert Tenancy.cache_salt(one, "x") == f"{one}:x"
    for header in (None, "Bearer k3", "k1", "Basic k1"):
        with pytest.raises(APIError) as caught:
            tenancy.tenant(header)
        assert caught.value.status == 401


def test_without_keys_the_client_salt_is_used_as_is() -> None:
    tenancy = Tenancy([])
    assert not tenancy.enabled
    assert tenancy.tenant(None) is None
    assert tenancy.tenant("Bearer anything") is None
    assert Tenancy.cache_salt(None, None) is None
    assert Tenancy.cache_salt(None, "abc") == "abc"
