// Package idempotency runs a tool call at most once per idempotency key, on the durable
// store's tool records (package store), across retries, duplicate calls and crashed
// processes.
//
// Executor.Do with a key:
//   - no record, or an abandoned one: it claims the record (a lease of Config.LeaseTTL,
//     renewed every third of it while the call runs), runs the call, and completes the
//     record with the result and the call's side effects (KVPut, Notify) in one
//     transaction, so the effect and the record commit together;
//   - a record in progress under another live lease (a duplicate call racing the first,
//     or a retry while the first attempt still runs elsewhere): it joins, waiting for the
//     record's result instead of executing again, and takes the record over if its lease
//     expires first (the owner crashed);
//   - a record done: it returns the stored result without running anything;
//   - a record failed for good: it returns the stored failure.
//
// While the store is out of reach (store.ErrUnavailable: PostgreSQL restarting), Do
// waits for it before claiming, trying again with backoff while the call's context
// lives: nothing has run yet, so the wait costs the call time, not an effect.
//
// A call that fails with a retryable error, or is cancelled, before completing releases
// its record, so the next attempt runs at once; a permanent failure (a client error) is
// stored. Release happens only without effects: effects are applied only by completion.
//
// DeriveKey makes the key when the caller gave none: from run, node, tool and a canonical
// hash of the arguments (JSON with sorted keys, no insignificant whitespace), so that the
// same call in the same place of the same run has the same key, and any other call a
// different one.
package idempotency
