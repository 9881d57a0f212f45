"""The SDK's TLS and token advice names its keywords (``tls=TlsConfig(...)``,
``token=``): torchrun's handler says each in --rdzv-conf keys. Run in the torch venv,
which the handler needs (torch's rendezvous API)."""

from __future__ import annotations

import json
import subprocess

#: Each SDK phrase in an AuthenticationError, as torchrun's handler words it.
SCRIPT = """
import json
from rendezvousd.client.connection import TLS_WORDS
from rendezvousd.client.errors import TOKEN_ADVICE, AuthenticationError
from rendezvousd.trainer.torchrun.handler import _in_torchruns_words

print(json.dumps({
    advice: _in_torchruns_words(AuthenticationError(f"refused: {advice}."))
    for advice in (*TLS_WORDS, TOKEN_ADVICE)
}))
"""


def test_every_sdk_tls_and_token_advice_is_said_in_rdzv_conf_keys(torch_python: str) -> None:
    """Only the CA's advice was rewritten: a TLS client of a plaintext daemon read the
    SDK's "drop tls_ca (--tls-ca / RENDEZVOUSD_TLS_CA)", naming a flag torchrun lacks."""
    done = subprocess.run(
        [torch_python, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    assert len(said) == 5, said
    for advice, words in said.items():
        assert words is not None, advice
        assert "TlsConfig" not in words and "tls=" not in words and "token=" not in words
        assert "--rdzv-conf" in words and "--tls-" not in words, words
    assert "refused: drop tls_ca from --rdzv-conf (and RENDEZVOUSD_TLS_CA)." in said.values()
