// Package retryid keeps a service's in-flight table of attempts keyed by tenant, method and
// retry-id (curfew-retry-id, minted once per logical call by the client and identical on
// every attempt), so that at most one attempt of a logical call runs on a service at any
// instant: a retry can never run a second decoder beside the first.
//
// When an attempt arrives while an earlier attempt with the same key is still running, the
// earlier one is cancelled with cause superseded, and the new one starts only once the
// earlier one's handler has returned (its teardown done). If that takes longer than the
// grace (DefaultGrace), the new attempt is rejected with ABORTED. An attempt older than the
// one running (a late duplicate) is rejected with ABORTED too.
//
// A hedged call's backup (curfew-hedge: 1, package mesh/hedge) is the one exception to
// "one attempt per retry-id": it is keyed apart from its twin, so the two run side by
// side (the caller cancels the loser), and each is still at most one attempt at a time.
package retryid
