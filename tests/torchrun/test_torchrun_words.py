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

#: A swapped client pair, as the SDK refuses it when the client is made.
SWAPPED = """
from pathlib import Path
from rendezvousd.client.connection import _swapped
from rendezvousd.client.errors import InvalidRequest
from rendezvousd.trainer.torchrun.handler import _in_torchruns_words

key = Path("/nonexistent/client.pem")
print(_in_torchruns_words(InvalidRequest(_swapped(Path("/c"), key, b"-----BEGIN CERTIFICATE-----"))))
"""


def test_every_sdk_tls_and_token_advice_is_said_in_rdzv_conf_keys(torch_python: str) -> None:
    """Only the CA's advice was rewritten: a TLS client of a plaintext daemon read the
    SDK's "drop tls_ca (--tls-ca / RENDEZVOUSD_TLS_CA)", naming a flag torchrun lacks."""
    done = subprocess.run(
        [torch_python, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    assert len(said) == 6, said
    for advice, words in said.items():
        assert words is not None, advice
        assert "TlsConfig" not in words and "tls=" not in words and "token=" not in words
        assert "--rdzv-conf" in words and "--tls-" not in words, words
    assert "refused: drop tls_ca from --rdzv-conf (and RENDEZVOUSD_TLS_CA)." in said.values()


def test_a_swapped_client_pair_is_said_in_rdzv_conf_keys(torch_python: str) -> None:
    """It read the SDK's "give the client certificate as cert= (--tls-cert)": neither
    a keyword nor a flag torchrun's user has; an InvalidRequest, which kept the SDK's."""
    done = subprocess.run(
        [torch_python, "-c", SWAPPED], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout.splitlines()[-1]
    assert said.endswith(
        "the two look swapped; give the client certificate as --rdzv-conf tls_cert (or "
        "RENDEZVOUSD_TLS_CERT) and its private key as tls_key (or RENDEZVOUSD_TLS_KEY)"
    ), said
    assert "TlsConfig" not in said and "--tls-" not in said, said
