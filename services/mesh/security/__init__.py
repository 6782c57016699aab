"""Trust between the processes of a mesh, torch-free; both servers and every client
of ours use it, and all of it is off unless configured.

    settings.py  SecuritySettings: TLS files, token files, the pause limit (file, env, flags)
    tokens.py    bearer tokens, the tokens file, secrets kept in files, Principal
    auth.py      AuthInterceptor: each method's rule (anyone, admin, mesh) checked per call
    dialing.py   TLS credentials for servers and channels; Dialing: how a client connects
    certs.py     a throwaway mesh CA (omni up --tls, tests); needs ``cryptography``
"""

from services.mesh.security.auth import (
    Authenticator,
    AuthInterceptor,
    admin_only,
    anyone,
    mesh_only,
    orchestrator_authenticator,
    stage_authenticator,
)
from services.mesh.security.dialing import (
    PLAINTEXT,
    Dialing,
    channel_credentials,
    client_dialing,
    mesh_dialing,
    server_credentials,
)
from services.mesh.security.settings import ENV, SecuritySettings
from services.mesh.security.tokens import (
    ANONYMOUS,
    Principal,
    Tokens,
    bearer,
    read_secret,
    token_metadata,
)

__all__ = [
    "ANONYMOUS",
    "ENV",
    "PLAINTEXT",
    "AuthInterceptor",
    "Authenticator",
    "Dialing",
    "Principal",
    "SecuritySettings",
    "Tokens",
    "admin_only",
    "anyone",
    "bearer",
    "channel_credentials",
    "client_dialing",
    "mesh_dialing",
    "mesh_only",
    "orchestrator_authenticator",
    "read_secret",
    "server_credentials",
    "stage_authenticator",
    "token_metadata",
]
