package mesh

import (
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/resolver/dns"

	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

// ClientConfig configures the client chain of one connection. The zero value is usable:
// retries by retry.Config's defaults, no breaker.
type ClientConfig struct {
	// Retry is the retry policy of this connection (one target).
	Retry retry.Config
	// Breakers, when set and not Off, guards every attempt on this connection with the
	// set's breaker for Retry.Target (the downstream service's name): one breaker per
	// target, shared by every connection to it that uses the same set.
	Breakers *breaker.Set
	// Metrics, when set, records the standard gRPC client metrics, outermost: one
	// logical call each, whatever its attempts (curfew_retry_attempts_total counts
	// those). nil records none.
	Metrics *ClientMetrics
}

// clientChain is the client chain, outermost first; the package doc lists the same
// layers, and a test holds the two together. A layer whose setting is off is left out.
var clientChain = []clientLayer{
	{"metrics", "outermost, so it counts one logical call with its final code and whole duration, retries included", clientMetrics},
	{"retry", "outside everything per attempt, so it stamps and sees every attempt, the breaker's refusals included", clientRetry},
	{"breaker", "innermost, next to the transport, so it counts what the target did to each attempt and refuses before anything is sent", clientBreaker},
}

// A clientLayer is one named layer of the client chain and why it sits where it does.
// build returns its interceptors under a config, nil ones when it is off.
type clientLayer struct {
	name  string
	why   string
	build func(ClientConfig) (grpc.UnaryClientInterceptor, grpc.StreamClientInterceptor)
}

func clientMetrics(cfg ClientConfig) (grpc.UnaryClientInterceptor, grpc.StreamClientInterceptor) {
	if cfg.Metrics == nil {
		return nil, nil
	}
	return cfg.Metrics.grpc.UnaryClientInterceptor(), cfg.Metrics.grpc.StreamClientInterceptor()
}

// clientRetry runs the attempts and stamps each (retry.Config.StampIdentity): identity,
// curfew-deadline, retry-id and attempt in one metadata append. The values come from the
// call's context, so they are the same on every attempt.
func clientRetry(cfg ClientConfig) (grpc.UnaryClientInterceptor, grpc.StreamClientInterceptor) {
	rc := cfg.Retry
	rc.StampIdentity = true
	return retry.ClientInterceptors(rc)
}

func clientBreaker(cfg ClientConfig) (grpc.UnaryClientInterceptor, grpc.StreamClientInterceptor) {
	if cfg.Breakers == nil || cfg.Breakers.Config().Off {
		return nil, nil
	}
	return cfg.Breakers.UnaryClientInterceptor(cfg.Retry.Target), cfg.Breakers.StreamClientInterceptor(cfg.Retry.Target)
}

// DialOptions returns the grpc.DialOptions that install curfew's client chain on one
// connection (clientChain, the package doc). Transport credentials and tracing are the
// caller's to add.
//
// The connection balances calls over every address its target resolves to
// (LoadBalancingConfig, round_robin): a dns:/// target of a headless Service reaches every
// ready replica, where gRPC's default, pick_first, would send every call to one of them
// and leave replicas the autoscaler adds idle. A target of one address is unaffected.
func DialOptions(cfg ClientConfig) []grpc.DialOption {
	var us []grpc.UnaryClientInterceptor
	var ss []grpc.StreamClientInterceptor
	for _, l := range clientChain {
		if u, s := l.build(cfg); u != nil {
			us, ss = append(us, u), append(ss, s)
		}
	}
	return []grpc.DialOption{grpc.WithChainUnaryInterceptor(us...), grpc.WithChainStreamInterceptor(ss...),
		grpc.WithDefaultServiceConfig(LoadBalancingConfig),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: reconnectBackoff, MinConnectTimeout: 20 * time.Second})}
}

// ReconnectMaxDelay caps the wait between two attempts of a connection to reach an
// address it lost or could not reach (reconnectBackoff).
const ReconnectMaxDelay = 5 * time.Second

// reconnectBackoff is how DialOptions' connections space their attempts to reach an
// address: 1 s, then ×1.6 with ±20 % jitter, as grpc-go's default, but at most
// ReconnectMaxDelay apart where grpc-go's default grows to 120 s. With the default, a
// replica down for a minute is reached again only 10-30 s after it is back (its callers'
// attempts have grown that far apart), and a service whose only replica restarted stays
// unreachable that long; capped, it is reached within ReconnectMaxDelay. An attempt
// to a dead address on the local network costs a refused SYN, so the cap costs nothing.
var reconnectBackoff = backoff.Config{BaseDelay: time.Second, Multiplier: 1.6, Jitter: 0.2, MaxDelay: ReconnectMaxDelay}

// DNSReresolveInterval is the least time between two DNS resolutions of one dns:///
// target, for every connection of the process (grpc-go's default is 30 s). A connection
// re-resolves its target when an address fails; with 30 s, a client whose last answer held
// only pods that a rolling update has since replaced would fail its calls for up to 30 s
// while the new pods are ready. One second matches mesh/replicas' own rate.
const DNSReresolveInterval = time.Second

func init() {
	// Process-wide, and only allowed at init time.
	dns.SetMinResolutionInterval(DNSReresolveInterval)
}

// LoadBalancingConfig is the default service config of DialOptions' connections: calls
// round-robin over every address of the target. A service config the target's resolver
// returns (DNS TXT records, which grpc-go ignores by default) would override it.
const LoadBalancingConfig = `{"loadBalancingConfig": [{"round_robin": {}}]}`
