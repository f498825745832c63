package toolrunner

import (
	"context"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/md"
)

// DefaultKeyRetention is how long a finished idempotency record is kept in memory.
const DefaultKeyRetention = time.Hour

// keys dedupes tool calls by idempotency key, in memory: a call whose key is done returns
// the stored result without running again; one whose key is in progress waits for that
// result; one whose key failed runs again (the tool itself makes its effect happen once,
// as deploy does by keying its job). Keys are namespaced by tenant. The durable store will
// make this survive restarts.
type keys struct {
	mu sync.Mutex
	m  map[string]*keyRecord
}

type keyRecord struct {
	done  chan struct{} // closed when the run ends
	out   string
	err   error
	ended time.Time
}

func newKeys() *keys { return &keys{m: map[string]*keyRecord{}} }

func keyOf(ctx context.Context, key string) string {
	return md.IdentityFrom(ctx).Tenant + "\x00" + key
}

// claim returns (nil, rec, true) when the call must wait for or replay rec, or a func to
// finish the record when this call is to run.
func (k *keys) claim(key string) (finish func(string, error), rec *keyRecord) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if r := k.m[key]; r != nil {
		select {
		case <-r.done:
			if r.err == nil {
				return nil, r // done: replay
			}
			// failed: run again
		default:
			return nil, r // in progress: join
		}
	}
	r := &keyRecord{done: make(chan struct{})}
	k.m[key] = r
	return func(out string, err error) {
		k.mu.Lock()
		r.out, r.err, r.ended = out, err, time.Now()
		k.mu.Unlock()
		close(r.done)
	}, nil
}

// wait returns rec's outcome once it has one.
func (k *keys) wait(ctx context.Context, r *keyRecord) (string, error) {
	select {
	case <-r.done:
	case <-ctx.Done():
		return "", status.FromContextError(ctx.Err()).Err()
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if r.err != nil {
		return "", status.Errorf(codes.Aborted, "the call with this idempotency key that this one joined failed: %v", status.Convert(r.err).Message())
	}
	return r.out, nil
}

// sweep forgets records that ended more than retention ago.
func (k *keys) sweep(now time.Time, retention time.Duration) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for key, r := range k.m {
		if !r.ended.IsZero() && now.Sub(r.ended) > retention {
			delete(k.m, key)
		}
	}
}

// jobs are deploy's jobs by idempotency key, so that a retried deploy attaches to the job
// its earlier attempt started instead of starting another.
type jobs struct {
	mu     sync.Mutex
	next   int64
	byKey  map[string]*job
	starts map[string]int
}

type job struct {
	id   int64
	done time.Time
}

func newJobs() *jobs { return &jobs{byKey: map[string]*job{}, starts: map[string]int{}} }

// start starts a job taking d, or returns the one key already started; started reports
// whether this call started it, starts how many jobs were ever started for key (1 unless
// the effect was duplicated).
func (j *jobs) start(key string, d time.Duration) (jb *job, started bool, starts int) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if key != "" {
		if jb := j.byKey[key]; jb != nil {
			return jb, false, j.starts[key]
		}
	}
	j.next++
	jb = &job{id: j.next, done: time.Now().Add(d)}
	if key == "" {
		return jb, true, 1
	}
	j.byKey[key] = jb
	j.starts[key]++
	return jb, true, j.starts[key]
}
