package budget

import "context"

// ledgerRef names a call's decoder in the token ledger: the run its entries are
// attributed to and the key whose parts (key/<k>…) they are.
type ledgerRef struct{ run, key string }

type ledgerRefKey struct{}

// WithLedger returns ctx carrying the name of the call's spend in the token ledger: the
// run its ledger entries are attributed to and its decoder's key, whose parts are the
// entries keyed key/<k>… (modelproxy's persist.go). A [Shared] reservation made with it
// records them on its hold, so that a hold its replica never settles (a crash) is
// charged what the ledger has of the call when it lapses, rather than nothing
// (docs/cluster.md, "When a replica crashes"). [Memory] has no use for it: its holds die
// with the process.
func WithLedger(ctx context.Context, run, key string) context.Context {
	return context.WithValue(ctx, ledgerRefKey{}, ledgerRef{run: run, key: key})
}

// ledgerOf is the ledger name WithLedger put in ctx (zero: none).
func ledgerOf(ctx context.Context) ledgerRef {
	r, _ := ctx.Value(ledgerRefKey{}).(ledgerRef)
	return r
}
