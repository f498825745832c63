// Package console is the orchestrator's web console: a list of runs, a run's tree on one
// time axis against its deadline, live while it runs, with Cancel and Approve/Deny, and
// the mesh's health from AdminService.Status with dead letters to replay.
//
// Every page is rendered on the server (html/template, assets embedded with go:embed, a
// strict Content-Security-Policy: no inline script or style, nothing from another
// origin). One small script follows a run over Server-Sent Events and refreshes the
// list.
//
// Who may see what is decided by the mesh, not here: a session holds the API key its
// user signed in with (encrypted in the cookie with the console secret), and every call
// the console makes goes over the orchestrator's own gRPC listener with that key, so the
// tenant guard and the operators' authorizer apply unchanged. A tenant's key sees its own
// runs; an operator's key (scope admin or read-only) names the run's tenant in
// curfew-tenant, which the guard allows only for operators' keys. The run list reads the
// store directly, for the key's tenant or, for an operator's key, every tenant.
//
// Sessions are stateless (any replica with the same secret serves them), expire
// (DefaultSessionTTL), end when their key is revoked, and end on sign-out on every
// replica (a store control, polled). Every POST carries a CSRF token derived from the
// session. docs/console.md is the user's guide.
package console
