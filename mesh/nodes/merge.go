package nodes

import (
	"sort"

	"google.golang.org/protobuf/proto"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
)

// Merge folds the reports of several processes into one tree, sorted by path (the root
// first). Each node's record comes from its executor; notes (records of kind UNSPECIFIED
// left by the caller that cancelled it) give the cause the executor could not see; a
// cancelled node that still has no cause takes its nearest ancestor's.
func Merge(reports ...[]*meshv1.Node) []*meshv1.Node {
	base := map[string]*meshv1.Node{}
	notes := map[string]*meshv1.Node{}
	for _, rep := range reports {
		for _, n := range rep {
			if n.Kind == meshv1.NodeKind_NODE_KIND_UNSPECIFIED {
				if _, ok := notes[n.Id]; !ok {
					notes[n.Id] = n
				}
				continue
			}
			if _, ok := base[n.Id]; !ok {
				base[n.Id] = proto.Clone(n).(*meshv1.Node)
			}
		}
	}
	// Causes known locally: the executor's own, else the canceller's note.
	causes := make(map[string]meshv1.CancelCause, len(base)+len(notes))
	at := map[string]*meshv1.Node{}
	for id, n := range notes {
		causes[id] = n.Cause
		at[id] = n
	}
	for id, n := range base {
		if n.Cause != meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED {
			causes[id] = n.Cause
		}
	}
	out := make([]*meshv1.Node, 0, len(base))
	for id, n := range base {
		if stopped(n.Status) && n.Cause == meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED {
			for cur := id; cur != ""; cur = Parent(cur) {
				if c := causes[cur]; c != meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED {
					n.Cause = c
					if c == meshv1.CancelCause_CANCEL_CAUSE_DEADLINE {
						// Stopped by the deadline, even if the executor saw the caller's
						// RST_STREAM a moment before its own copy of the deadline fired.
						n.Status = meshv1.NodeStatus_NODE_STATUS_DEADLINE_EXCEEDED
					}
					if n.CancelledAt == nil && at[cur] != nil {
						n.CancelledAt = at[cur].CancelledAt
					}
					break
				}
			}
		}
		out = append(out, n)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Id < out[j].Id })
	return out
}

func stopped(s meshv1.NodeStatus) bool {
	return s == meshv1.NodeStatus_NODE_STATUS_CANCELLED || s == meshv1.NodeStatus_NODE_STATUS_DEADLINE_EXCEEDED
}
