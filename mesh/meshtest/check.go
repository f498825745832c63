package meshtest

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/nodes"
)

// WaitNode waits up to 3s for node of run (and the nodes beneath it) to end in tbl and
// returns node's record. It fails the test if they have not ended by then or node is not
// recorded.
func WaitNode(t testing.TB, tbl *nodes.Table, run, node string) *meshv1.Node {
	t.Helper()
	ns, settled := tbl.List(context.Background(), run, []string{node}, 3*time.Second)
	if !settled {
		t.Fatalf("node %s of run %s did not end within 3s: %v", node, run, ns)
	}
	for _, n := range ns {
		if n.GetId() == node {
			return n
		}
	}
	t.Fatalf("node %s of run %s not recorded (have %v)", node, run, ns)
	return nil
}

// WantCode fails the test unless err has the gRPC status code code and its status
// message contains each of contains.
func WantCode(t testing.TB, err error, code codes.Code, contains ...string) {
	t.Helper()
	if status.Code(err) != code {
		t.Fatalf("error = %v, want code %v", err, code)
	}
	for _, c := range contains {
		if !strings.Contains(status.Convert(err).Message(), c) {
			t.Fatalf("error message %q does not mention %q", status.Convert(err).Message(), c)
		}
	}
}

// Drain receives from a server stream until it ends. It returns the messages received
// and nil when the stream ended with io.EOF, or the messages received before the error
// and the error.
func Drain[T any](st grpc.ServerStreamingClient[T]) ([]*T, error) {
	var out []*T
	for {
		m, err := st.Recv()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return out, err
		}
		out = append(out, m)
	}
}
