package nodes

import meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"

// InFlightTokenAllowance is how many tokens a decoder may emit after its run's cancel
// instant without them counting as orphan tokens: the orchestrator records the instant
// just before the stop signal leaves, so a token already being emitted can land in
// between. It is the bound every test of the cancel path holds: at most one per decoder.
const InFlightTokenAllowance = 1

// OrphanTokens is what a node decoded after its run's cancel beyond the in-flight
// allowance: tokens of a decoder that went on decoding. 0 for nodes that are not model
// decoders.
func OrphanTokens(n *meshv1.Node) int64 {
	if n.GetKind() != meshv1.NodeKind_NODE_KIND_MODEL {
		return 0
	}
	return max(0, n.GetTokensAfterCancel()-InFlightTokenAllowance)
}
