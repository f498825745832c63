package idempotency

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// Defaults of Config's zero fields.
const (
	// DefaultLeaseTTL is how long a claim holds a record without a heartbeat; a crashed
	// owner's record is taken over that long after its last heartbeat.
	DefaultLeaseTTL = 10 * time.Second
	// DefaultMaxPoll bounds the wait between two looks at a joined record.
	DefaultMaxPoll = 100 * time.Millisecond
)

// Config configures an Executor.
type Config struct {
	// Store holds the records; required (a memory store serves a process of its own).
	Store store.Tools
	// Owner names this process incarnation (unique per restart); required.
	Owner    string
	LeaseTTL time.Duration
	MaxPoll  time.Duration
	// Now is the store's clock; time.Now when nil.
	Now func() time.Time
}

// Executor runs calls at most once per key.
type Executor struct{ cfg Config }

// New returns an Executor.
func New(cfg Config) (*Executor, error) {
	if cfg.Store == nil || cfg.Owner == "" {
		return nil, errors.New("idempotency: Store and Owner are required")
	}
	if cfg.LeaseTTL <= 0 {
		cfg.LeaseTTL = DefaultLeaseTTL
	}
	if cfg.MaxPoll <= 0 {
		cfg.MaxPoll = DefaultMaxPoll
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Executor{cfg: cfg}, nil
}

// Call is one tool call.
type Call struct {
	Tenant string
	Key    string // required: the caller's key, or DeriveKey's
	RunID  string // informational
	Tool   string // informational
}

// Result is what a call returns: its result, and the side effects to apply exactly
// once, with the record's completion.
type Result struct {
	Value   []byte
	Effects []store.Effect
	// RequireLive: the effects are irreversible, so they are applied only while the
	// call's context is live; a call cancelled after its function returned releases the
	// record instead of completing it.
	RequireLive bool
}

// Outcome says how Do answered.
type Outcome int

// Outcomes of Do.
const (
	// Executed: this call ran the function: the first time, after an attempt that
	// released the record, or taking over a record a crashed owner left (the record's
	// epoch then counts the claims).
	Executed Outcome = iota + 1
	// Joined: another call was running it; this one waited for its result.
	Joined
	// Replayed: the record was already done (or failed); nothing ran.
	Replayed
)

func (o Outcome) String() string {
	return [...]string{"", "executed", "joined", "replayed"}[o]
}

// Permanent reports whether a call's error is stored as the record's failure (a client
// error: running it again would fail alike) rather than released for a retry.
func Permanent(err error) bool {
	switch status.Code(err) {
	case codes.InvalidArgument, codes.NotFound, codes.AlreadyExists, codes.PermissionDenied,
		codes.FailedPrecondition, codes.OutOfRange, codes.Unimplemented, codes.Unauthenticated:
		return true
	}
	return false
}

// Do runs fn for c at most once per c.Key (see the package doc). The error is fn's, a
// stored failure (with the stored code and message), or a
// store error as a gRPC status.
func (e *Executor) Do(ctx context.Context, c Call, fn func(ctx context.Context) (Result, error)) ([]byte, Outcome, error) {
	if c.Key == "" || c.Tenant == "" {
		return nil, 0, status.Error(codes.InvalidArgument, "idempotency: tenant and key are required")
	}
	joined := false
	for {
		b, err := e.begin(ctx, store.ToolBegin{Tenant: c.Tenant, Key: c.Key, Owner: e.cfg.Owner, TTL: e.cfg.LeaseTTL, RunID: c.RunID, Tool: c.Tool})
		if err != nil {
			return nil, 0, storeErr(ctx, err)
		}
		switch b.Outcome {
		case store.BeginDone:
			if joined {
				return b.Record.Result, Joined, nil
			}
			return b.Record.Result, Replayed, nil
		case store.BeginFailed:
			o := Replayed
			if joined {
				o = Joined
			}
			return nil, o, storedFailure(b.Record)
		case store.BeginInProgress:
			joined = true
			if _, err := store.WaitTool(ctx, e.cfg.Store, c.Tenant, c.Key, e.cfg.MaxPoll, e.cfg.Now); err != nil {
				return nil, Joined, storeErr(ctx, err)
			}
			continue // done, failed, released or expired: look again
		case store.BeginStarted:
			v, err := e.run(ctx, b.Claim, fn)
			return v, Executed, err
		default:
			return nil, 0, status.Errorf(codes.Internal, "idempotency: unknown begin outcome %v", b.Outcome)
		}
	}
}

// beginWait paces the tries of BeginTool while the store is unavailable: full jitter
// under a ceiling of 50 ms, doubling with each try up to 1 s, for as long as the call's
// context lives.
var beginWait = retry.Policy{Base: 50 * time.Millisecond, Cap: time.Second}

// begin is BeginTool, tried again while the store is out of reach (store.ErrUnavailable)
// and ctx lives: nothing has run for the call yet, so waiting for the store costs the
// call time, never an effect, where failing would make its caller retry or fail it.
func (e *Executor) begin(ctx context.Context, tb store.ToolBegin) (store.Begin, error) {
	for try := 1; ; try++ {
		b, err := e.cfg.Store.BeginTool(ctx, tb)
		if !errors.Is(err, store.ErrUnavailable) {
			return b, err
		}
		t := time.NewTimer(beginWait.Backoff(try+1, rand.Float64))
		select {
		case <-ctx.Done():
			t.Stop()
			return b, err
		case <-t.C:
		}
	}
}

// run executes fn under the claim, heartbeating its lease, and settles the record.
func (e *Executor) run(ctx context.Context, claim store.ToolClaim, fn func(ctx context.Context) (Result, error)) ([]byte, error) {
	hbCtx, stopHB := context.WithCancel(ctx)
	hbDone := make(chan error, 1)
	go func() { hbDone <- e.heartbeat(hbCtx, claim) }()
	res, err := fn(ctx)
	stopHB()
	lost := <-hbDone // the lease was taken over while fn ran
	// Settle with a context of its own: a cancelled call must still release its record,
	// or the next attempt would wait a whole lease for it.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err != nil {
		if Permanent(err) {
			s := status.Convert(err)
			_ = e.cfg.Store.FailTool(sctx, claim, s.Code().String(), s.Message())
		} else {
			_ = e.cfg.Store.ReleaseTool(sctx, claim)
		}
		return nil, err
	}
	if res.RequireLive && ctx.Err() != nil {
		_ = e.cfg.Store.ReleaseTool(sctx, claim)
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	if lost != nil {
		return nil, status.Errorf(codes.Aborted, "idempotency: the record of %q was taken over while this call ran", claim.Key)
	}
	if cerr := e.cfg.Store.CompleteTool(sctx, claim, res.Value, res.Effects...); cerr != nil {
		if errors.Is(cerr, store.ErrStaleEpoch) {
			return nil, status.Errorf(codes.Aborted, "idempotency: the record of %q was taken over; its effects are the new owner's", claim.Key)
		}
		return nil, storeErr(ctx, cerr)
	}
	return res.Value, nil
}

// heartbeat renews the claim every third of the lease until ctx ends; it returns the
// error that lost the claim, or nil.
func (e *Executor) heartbeat(ctx context.Context, claim store.ToolClaim) error {
	t := time.NewTicker(e.cfg.LeaseTTL / 3)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			if err := e.cfg.Store.HeartbeatTool(ctx, claim, e.cfg.LeaseTTL); err != nil {
				if errors.Is(err, store.ErrStaleEpoch) {
					return err
				}
				// A transient store error: try again at the next tick, while the lease lasts.
			}
		}
	}
}

func storedFailure(r store.ToolRecord) error {
	code := codes.FailedPrecondition
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		if c.String() == r.ErrorType {
			code = c
		}
	}
	return status.Errorf(code, "%s (stored result of an earlier execution)", r.Error)
}

func storeErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return status.FromContextError(ctx.Err()).Err()
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.Errorf(store.Code(err), "idempotency: %v", err)
}

// DeriveKey returns the key of a call without one: a hash of run, node, tool and the
// canonical form of args (a JSON value). Arguments that differ only in key order or
// whitespace give the same key.
func DeriveKey(run, node, tool string, args []byte) (string, error) {
	canon, err := Canonical(args)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	for _, p := range [][]byte{[]byte(run), []byte(node), []byte(tool), canon} {
		fmt.Fprintf(h, "%d:", len(p))
		h.Write(p)
	}
	return "derived:" + hex.EncodeToString(h.Sum(nil)), nil
}

// Canonical re-encodes a JSON value with object keys sorted and no insignificant
// whitespace; numbers keep their literal form. Empty input is the empty object.
func Canonical(args []byte) ([]byte, error) {
	if len(bytes.TrimSpace(args)) == 0 {
		return []byte("{}"), nil
	}
	dec := json.NewDecoder(bytes.NewReader(args))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, fmt.Errorf("arguments are not JSON: %w", err)
	}
	if dec.More() {
		return nil, errors.New("arguments: trailing data after the JSON value")
	}
	return json.Marshal(v) // encoding/json sorts map keys
}
