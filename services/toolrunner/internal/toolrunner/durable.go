package toolrunner

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/idempotency"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/plan"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// durable runs a kv_put or notify call once per idempotency key on the store: the
// caller's key, or one derived from run, node, tool and the canonical arguments (the agent
// loop derives the same one). A duplicate joins the running call, a repeat gets the
// stored result, and the effect commits with the record, so it happens exactly once.
// The effects are for other processes (an outbox's sender, kv readers) and must
// survive this one, so a store private to the process refuses them.
func (s *Server) durable(name string, raw []byte) execFunc {
	return func(ctx context.Context) (string, *meshv1.Cleanup, error) {
		if !s.cfg.Store.Shared() {
			return "", nil, status.Errorf(codes.FailedPrecondition, "tool %s needs toolrunner's durable store (--store)", name)
		}
		id := md.IdentityFrom(ctx)
		key := md.IdempotencyKeyFrom(ctx)
		if key == "" {
			k, err := idempotency.DeriveKey(id.RunID, id.NodeID, name, raw)
			if err != nil {
				return "", nil, status.Errorf(codes.InvalidArgument, "tool %s: %v", name, err)
			}
			key = k
		}
		tenant := id.Tenant
		if tenant == "" {
			tenant = md.DefaultTenant
		}
		fn, err := durableFunc(name, raw)
		if err != nil {
			return "", nil, err
		}
		out, outcome, err := s.idem.Do(ctx, idempotency.Call{Tenant: tenant, Key: key, RunID: id.RunID, Tool: name}, fn)
		if err != nil {
			return "", nil, err
		}
		if outcome == idempotency.Executed {
			s.effects.WithLabelValues(name).Inc()
		}
		return string(out), nil, nil
	}
}

// durableFunc returns the call's effect. notify checks, as late as it can, that its node
// is not cancelled and that its grace is left: a notification cannot be taken back.
func durableFunc(name string, raw []byte) (func(ctx context.Context) (idempotency.Result, error), error) {
	switch name {
	case plan.ToolKVPut:
		var a plan.KVPutArgs
		_ = plan.Args(raw, &a) // validated by prepare
		out, _ := json.Marshal(map[string]any{"key": a.Key, "written": true})
		return func(context.Context) (idempotency.Result, error) {
			return idempotency.Result{Value: out, Effects: []store.Effect{store.KVPut{Key: a.Key, Value: a.Value}}}, nil
		}, nil
	case plan.ToolNotify:
		var a plan.NotifyArgs
		_ = plan.Args(raw, &a)
		grace := time.Duration(a.GraceMS) * time.Millisecond
		if a.GraceMS == 0 {
			grace = plan.DefaultNotifyGrace * time.Millisecond
		}
		out, _ := json.Marshal(map[string]any{"channel": a.Channel, "queued": true})
		return func(ctx context.Context) (idempotency.Result, error) {
			if err := ctx.Err(); err != nil {
				return idempotency.Result{}, status.FromContextError(err).Err()
			}
			if dl, ok := ctx.Deadline(); ok && time.Until(dl) < grace {
				return idempotency.Result{}, status.Errorf(codes.DeadlineExceeded,
					"notify: %v left, less than its grace %v: not sent", time.Until(dl).Round(time.Millisecond), grace)
			}
			return idempotency.Result{Value: out, RequireLive: true,
				Effects: []store.Effect{store.Notify{Channel: a.Channel, Payload: []byte(a.Message)}}}, nil
		}, nil
	}
	return nil, status.Errorf(codes.Internal, "tool %s is not durable", fmt.Sprint(name))
}
