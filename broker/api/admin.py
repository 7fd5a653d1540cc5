"""The routes of API tokens: who the caller is (any token), and creating, listing and
revoking tokens (admins only). Revoking empties the app's token cache so the token
stops working at once, not after the cache's TTL.
"""

from fastapi import APIRouter
from sqlalchemy import select

from broker.api.deps import Admin, AnyWho, AppClock, CachedTokens, Db, RowId
from broker.api.responses import AUTH, BODY, errors
from broker.core import auth
from broker.core.models import ApiToken
from broker.core.schemas import TokenCreate, TokenCreated, TokenOut, Whoami

router = APIRouter(responses=errors(*AUTH))


@router.get("/v1/whoami", response_model=Whoami, tags=["auth"])
def whoami(who: AnyWho) -> Whoami:
    return Whoami(user=who.user, tenant=who.tenant, role=who.role)


@router.post(
    "/v1/admin/tokens", response_model=TokenCreated, status_code=201, tags=["admin"], responses=errors(403, *BODY)
)
def create_token(body: TokenCreate, session: Db, _who: Admin, clock: AppClock) -> TokenCreated:
    """Create an API token; its secret is in this response only."""
    with session.begin():
        row, secret = auth.create_token(
            session,
            user=body.user,
            tenant=body.tenant,
            role=body.role,
            description=body.description,
            now=clock(),
            nodes=body.nodes,
        )
        return TokenCreated(**TokenOut.model_validate(row, from_attributes=True).model_dump(), token=secret)


@router.get("/v1/admin/tokens", response_model=list[TokenOut], tags=["admin"], responses=errors(403))
def list_tokens(session: Db, _who: Admin) -> list[TokenOut]:
    with session.begin():
        rows = session.execute(select(ApiToken).order_by(ApiToken.id)).scalars()
        return [TokenOut.model_validate(r, from_attributes=True) for r in rows]


@router.post(
    "/v1/admin/tokens/{token_id}/revoke", response_model=TokenOut, tags=["admin"], responses=errors(403, 404, 422)
)
def revoke_token(token_id: RowId, session: Db, _who: Admin, clock: AppClock, cache: CachedTokens) -> TokenOut:
    with session.begin():
        row = auth.revoke_token(session, token_id, now=clock())
        out = TokenOut.model_validate(row, from_attributes=True)
    cache.clear()
    return out
