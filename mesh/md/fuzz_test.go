package md_test

import (
	"context"
	"testing"

	"google.golang.org/grpc/metadata"

	"github.com/curfew-mesh/curfew/mesh/md"
)

// FuzzFromIncoming feeds arbitrary header values (what any caller can send) to the
// metadata parsers: they must never panic, and what they return must be sane.
func FuzzFromIncoming(f *testing.F) {
	f.Add("1764460800000", "01a22c27-439a-718e-b1bc-9693df540c95", "2", "root/s0.t1/sub/m0", "acme")
	f.Add("", "", "", "", "")
	f.Add("-5", "x", "-1", "/", "\x00")
	f.Add("9223372036854775807", "\xff\xfe", "99999999999999999999", "root/../..", "tenant with spaces")
	f.Add("1e3", "", "0", "root", "default")
	f.Fuzz(func(t *testing.T, deadline, retryID, attempt, node, tenant string) {
		ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(
			md.Deadline, deadline, md.RetryID, retryID, md.Attempt, attempt, md.NodeID, node, md.Tenant, tenant))
		id := md.FromIncoming(ctx)
		if id.Attempt < 0 {
			t.Fatalf("attempt %d from %q", id.Attempt, attempt)
		}
		if id.Tenant == "" {
			t.Fatal("empty tenant: the default must apply")
		}
		if dl, ok := md.IncomingDeadline(ctx); ok && dl.UnixMilli() <= 0 {
			t.Fatalf("deadline %v accepted from %q", dl, deadline)
		}
		// What was read goes out again without panicking.
		out := md.AppendOutgoing(md.WithIdentity(context.Background(), id))
		if _, ok := metadata.FromOutgoingContext(out); !ok {
			t.Fatal("no outgoing metadata")
		}
	})
}
