package memory_test

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/memory"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestContract(t *testing.T) {
	storetest.Run(t, func(t *testing.T) string { return storetest.MemoryDSN(t) })
}

func open(t *testing.T, dsn string) store.Store {
	t.Helper()
	s, err := store.Open(context.Background(), dsn)
	if err != nil {
		t.Fatalf("open %s: %v", dsn, err)
	}
	return s
}

func create(t *testing.T, s store.Store) store.Run {
	t.Helper()
	r, _, err := s.CreateRun(context.Background(), store.NewRun{Tenant: "t", Deadline: time.Now().Add(time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func closeStore(t *testing.T, s store.Store) {
	t.Helper()
	if err := s.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
}

// Reopening a name sees its data while a store on it is open; another name does not.
func TestNamesShareWithinTheProcess(t *testing.T) {
	ctx := context.Background()
	a := open(t, "memory://"+t.Name()+"-a")
	defer closeStore(t, a)
	r := create(t, a)
	again := open(t, "memory://"+t.Name()+"-a")
	defer closeStore(t, again)
	if got, err := again.GetRun(ctx, "t", r.RunID); err != nil || got.RunID != r.RunID {
		t.Fatalf("the run through a second open of the name: %+v %v", got, err)
	}
	b := open(t, "memory://"+t.Name()+"-b")
	defer closeStore(t, b)
	if _, err := b.GetRun(ctx, "t", r.RunID); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("another name sees the run: %v", err)
	}
}

// The default name: memory:// and memory://default are one database.
func TestDefaultName(t *testing.T) {
	a := open(t, "memory://")
	defer closeStore(t, a)
	r := create(t, a)
	b := open(t, "memory://"+memory.DefaultName)
	defer closeStore(t, b)
	if _, err := b.GetRun(context.Background(), "t", r.RunID); err != nil {
		t.Fatalf("memory:// and memory://%s differ: %v", memory.DefaultName, err)
	}
}

// OpenOr: without a DSN, the memory store of the name; with one, the store it names.
func TestOpenOr(t *testing.T) {
	ctx := context.Background()
	named := open(t, "memory://"+t.Name())
	defer closeStore(t, named)
	r := create(t, named)
	dflt, err := memory.OpenOr(ctx, "", t.Name())
	if err != nil {
		t.Fatal(err)
	}
	defer closeStore(t, dflt)
	if _, err := dflt.GetRun(ctx, "t", r.RunID); err != nil {
		t.Fatalf("OpenOr without a DSN is not memory://%s: %v", t.Name(), err)
	}
	other, err := memory.OpenOr(ctx, "memory://"+t.Name()+"-other", t.Name())
	if err != nil {
		t.Fatal(err)
	}
	defer closeStore(t, other)
	if _, err := other.GetRun(ctx, "t", r.RunID); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("OpenOr with a DSN opened the name's store instead: %v", err)
	}
}

// Close: the closed store's calls fail, the others keep the data, and the last Close
// drops it.
func TestCloseRefCounts(t *testing.T) {
	ctx := context.Background()
	dsn := "memory://" + t.Name()
	a, b := open(t, dsn), open(t, dsn)
	r := create(t, a)
	closeStore(t, a)
	if err := a.Close(); err != nil {
		t.Fatalf("a second Close: %v", err)
	}
	if _, err := a.GetRun(ctx, "t", r.RunID); err == nil {
		t.Fatal("GetRun on a closed store succeeded")
	}
	if _, _, err := a.CreateRun(ctx, store.NewRun{Tenant: "t", Deadline: time.Now().Add(time.Minute)}); err == nil {
		t.Fatal("CreateRun on a closed store succeeded")
	}
	if _, err := b.GetRun(ctx, "t", r.RunID); err != nil {
		t.Fatalf("another store on the name lost the run when one closed: %v", err)
	}
	closeStore(t, b)
	c := open(t, dsn)
	defer closeStore(t, c)
	if _, err := c.GetRun(ctx, "t", r.RunID); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("the name after its last Close: %v, want empty", err)
	}
}

func TestShared(t *testing.T) {
	s := open(t, "memory://"+t.Name())
	defer closeStore(t, s)
	if s.Shared() {
		t.Fatal("a memory store says other processes share it")
	}
}

func TestBadDSN(t *testing.T) {
	for _, dsn := range []string{"memory://x?cache=shared", "memory://x#y"} {
		if _, err := store.Open(context.Background(), dsn); !errors.Is(err, store.ErrInvalidArgument) {
			t.Errorf("%s: %v, want ErrInvalidArgument", dsn, err)
		}
	}
}

func BenchmarkCheckpoint(b *testing.B) {
	storetest.BenchmarkCheckpoint(b, storetest.MemoryDSN(b))
}

// BenchmarkToolRecord is toolrunner's store work for one kv_put: BeginTool, then
// CompleteTool with its effect.
func BenchmarkToolRecord(b *testing.B) {
	ctx := context.Background()
	s := storetest.OpenMemory(b)
	timeEach(b, func(i int) {
		key := "k" + strconv.Itoa(i)
		bg, err := s.BeginTool(ctx, store.ToolBegin{Tenant: "t", Key: key, Owner: "o", TTL: time.Minute})
		if err != nil {
			b.Fatal(err)
		}
		if err := s.CompleteTool(ctx, bg.Claim, []byte(`{"written":true}`), store.KVPut{Key: key, Value: []byte(`1`)}); err != nil {
			b.Fatal(err)
		}
	})
}

// BenchmarkAddTokens is modelproxy's store work for one decoder: its output and orphan
// entries appended in one call.
func BenchmarkAddTokens(b *testing.B) {
	ctx := context.Background()
	s := storetest.OpenMemory(b)
	timeEach(b, func(i int) {
		key := "modelproxy/r/n/-/1/x." + strconv.Itoa(i)
		if _, err := s.AddTokens(ctx,
			store.LedgerEntry{Tenant: "t", RunID: "r", NodeID: "n", Tokens: 40, Kind: "output", Key: key},
			store.LedgerEntry{Tenant: "t", RunID: "r", NodeID: "n", Tokens: 3, Kind: "orphan", Key: key + "o"},
		); err != nil {
			b.Fatal(err)
		}
	})
}

// timeEach runs op(1), op(2), … as the benchmark's loop and reports the median call:
// on a loaded machine the mean says more about the scheduler than about the store.
func timeEach(b *testing.B, op func(i int)) {
	var lat []time.Duration
	for i := 1; b.Loop(); i++ {
		start := time.Now()
		op(i)
		lat = append(lat, time.Since(start))
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-us")
}
