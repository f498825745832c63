// Package admin serves curfew.admin.v1.AdminService, the operators' API: seed 003's
// rollback order (pools, decoder leases, ledger freezes, decoder drains, reopening on a
// quiet orphan delta), the mesh's status, API keys and usage, approvals and the outbox
// (docs/operations.md).
//
// # Who may call
//
// [Authorizer] decides, in the server chain's authenticate layer (before any handler):
// the curfew-cli mesh identity, or an API key with the admin scope, may call every
// method; a key with the read-only scope may call exactly the methods whose
// idempotency_level is NO_SIDE_EFFECTS in admin.proto ([ReadOnly]); any other caller
// is PERMISSION_DENIED, and one with neither a key nor a mesh identity UNAUTHENTICATED.
//
// # State
//
// Every decision is a row in the shared store (store.Operators), never a replica's
// memory, so a command sent to one orchestrator holds on every replica of every service
// that polls the controls. Every method that changes something appends an audit entry
// (who, when, what, why) after it succeeds; repeating a command is safe and adds one
// more entry.
package admin
