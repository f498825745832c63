package md_test

import (
	"context"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/md"
)

// FuzzFromIncoming feeds arbitrary header values (what any caller can send) to the
// contract's check and the metadata parsers: Check either passes them or refuses them with
// INVALID_ARGUMENT naming a header, never another code and never a panic; what passes
// parses to sane values.
func FuzzFromIncoming(f *testing.F) {
	f.Add("1764460800000", "01a22c27-439a-718e-b1bc-9693df540c95", "2", "root/s0.t1/sub/m0", "acme")
	f.Add("", "", "", "", "")
	f.Add("-5", "x", "-1", "/", "\x00")
	f.Add("9223372036854775807", "\xff\xfe", "99999999999999999999", "root/../..", "tenant with spaces")
	f.Add("1e3", "", "0", "root", "default")
	f.Add("1764460800000", "", "1", "root", "acme")
	f.Add("1764460800000", "r", "101", "a//b", "a:b")
	f.Fuzz(func(t *testing.T, deadline, retryID, attempt, node, tenant string) {
		ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(
			md.Deadline, deadline, md.RetryID, retryID, md.Attempt, attempt, md.NodeID, node, md.Tenant, tenant,
			md.RunID, node, md.IdempotencyKey, retryID))
		checkErr := md.Check(ctx)
		if checkErr != nil {
			if status.Code(checkErr) != codes.InvalidArgument {
				t.Fatalf("Check = %v, want INVALID_ARGUMENT or nil", checkErr)
			}
			if _, ok := md.InvalidHeader(checkErr); !ok {
				t.Fatalf("Check's refusal names no header: %v", checkErr)
			}
		}
		id := md.FromIncoming(ctx)
		if checkErr == nil {
			if id.Attempt > md.MaxAttempt {
				t.Fatalf("attempt %d passed the check", id.Attempt)
			}
			if !md.ValidTenant(id.Tenant) {
				t.Fatalf("tenant %q passed the check", id.Tenant)
			}
			if dl, ok := md.IncomingDeadline(ctx); ok && (dl.UnixMilli() < md.MinDeadlineMS || dl.UnixMilli() > md.MaxDeadlineMS) {
				t.Fatalf("deadline %v passed the check", dl)
			}
		}
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
