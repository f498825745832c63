// Package apikey makes, stores and checks tenants' API keys, the credentials external
// callers of the orchestrator present as a bearer token.
//
// A key looks like
//
//	cfk_<id>_<secret>
//
// where id is 16 lowercase base32 characters (80 random bits) and secret 43 base64url
// characters (256 random bits). The id is public: it names the key in the store, in
// logs and in `curfew tenant ls`. The secret is shown once, when the key is made; the
// store keeps only SHA-256(secret). A salted slow hash (bcrypt, argon2) protects
// passwords, which are guessable; a 256-bit random secret is not, so a fast hash loses
// nothing and keeps each check to one store lookup and one hash.
//
// Authenticator checks a call's `authorization: Bearer <key>` metadata against the store
// and returns the key's tenant. Every failure is UNAUTHENTICATED with the same message
// for an unknown, revoked or wrong key, so that a caller cannot tell them apart; the
// reason is logged at debug level with the key's id only, never its secret. While the
// store is out of reach (store.ErrUnavailable), a key is checked against its record as
// the store last verified it, at most StaleIfUnavailable (1 min by default) ago, so that a
// tenant can go on cancelling its runs through a restart of the store.
//
// Guard is the server chain's tenant authentication for a public API
// (mesh.ServerConfig.Authenticate): a call acts for the tenant of its verified key, or,
// from a trusted mesh peer without a key, for the tenant its curfew-tenant header names;
// anyone else is UNAUTHENTICATED, and a Limit (the per-tenant request rate) may refuse a
// call once its tenant is known. docs/security.md has the whole model.
package apikey
