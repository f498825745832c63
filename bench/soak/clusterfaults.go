package soak

import (
	"context"
	"errors"
	"fmt"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2/client"

	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// RestartAfter is how long a replica the cluster's faults kill stays down before they
// start it again (less in a load shorter than ten times it: a tenth of the load).
const RestartAfter = 3 * time.Second

// A toxic the cluster's faults switch on and off: on every proxy of service (or only
// replica, when not ""), at a share of the load's duration, for a share (or at least Min).
type toxic struct {
	service, replica string
	at, share        float64
	min              time.Duration
	kind, stream     string
	attrs            toxiproxy.Attributes
	why              string
}

// clusterToxics are the toxics of Cluster.Faults, in the order they come. Latency is put
// on responses (downstream) only: a cancel travels upstream and is not delayed, so a
// decoder's tokens after a cancel still measure the mesh, not the toxic.
var clusterToxics = []toxic{
	{service: "modelproxy", at: 0.05, share: 0.15, kind: "latency", stream: "downstream",
		attrs: toxiproxy.Attributes{"latency": 20, "jitter": 10}, why: "tokens reach their callers 10-30 ms late"},
	{service: "toolrunner", replica: "toolrunner-a", at: 0.45, min: time.Second, kind: "reset_peer", stream: "upstream",
		attrs: toxiproxy.Attributes{"timeout": 0}, why: "every connection to the replica reset (TCP RST)"},
	{service: "subagent", replica: "subagent-b", at: 0.62, min: 2 * time.Second, kind: "timeout", stream: "upstream",
		attrs: toxiproxy.Attributes{"timeout": 1000}, why: "requests to the replica go nowhere; its connections are closed after 1 s"},
	{service: "orchestrator", at: 0.82, share: 0.12, kind: "latency", stream: "downstream",
		attrs: toxiproxy.Attributes{"latency": 30, "jitter": 10}, why: "the front door's and forwarded calls' answers 20-40 ms late"},
}

// clusterKills are the replicas Cluster.Faults kills, and when (a share of the load).
var clusterKills = []struct {
	replica string
	at      float64
}{{"modelproxy-b", 0.15}, {"toolrunner-b", 0.35}, {"subagent-a", 0.55}, {"orchestrator-b", 0.75}}

// Faults are the cluster's faults over a load of duration d. With kill, one replica of
// each service is SIGKILLed (modelproxy-b, toolrunner-b, subagent-a, orchestrator-b,
// spread over the load) and started again RestartAfter later, on the same address. With
// toxics, toxiproxy puts on its hops, each for a while: 10-30 ms of latency on
// modelproxy's answers, TCP resets at toolrunner-a, a black hole closed after 1 s at
// subagent-b, 20-40 ms of latency at the orchestrators' front door.
func (c *Cluster) Faults(d time.Duration, kill, toxics bool) []Fault {
	var fs []Fault
	down := min(RestartAfter, d/10)
	if kill {
		for _, k := range clusterKills {
			p := c.replica(k.replica)
			if p == nil {
				continue
			}
			at := time.Duration(k.at * float64(d))
			fs = append(fs,
				Fault{At: at, Name: "SIGKILL " + k.replica, Do: func(context.Context) error { return p.Kill() }},
				Fault{At: at + down, Name: "restart " + k.replica, Do: func(ctx context.Context) error { return p.Start(ctx) }})
		}
	}
	if toxics {
		for i, t := range clusterToxics {
			proxies := c.proxiesOf(t.service, t.replica)
			at := time.Duration(t.at * float64(d))
			lasts := max(time.Duration(t.share*float64(d)), t.min)
			toxicName := fmt.Sprintf("soak-%d-%s", i, t.kind)
			where := t.service
			if t.replica != "" {
				where = t.replica
			}
			fs = append(fs,
				Fault{At: at, Name: fmt.Sprintf("%s on %s (%s) for %v", t.kind, where, t.why, lasts.Round(100*time.Millisecond)), Do: func(context.Context) error {
					var errs []error
					for _, px := range proxies {
						if _, err := px.AddToxic(toxicName, t.kind, t.stream, 1, t.attrs); err != nil {
							errs = append(errs, fmt.Errorf("%s: %w", px.Name, err))
						}
					}
					return errors.Join(errs...)
				}},
				Fault{At: at + lasts, Name: fmt.Sprintf("%s off on %s", t.kind, where), Do: func(context.Context) error {
					var errs []error
					for _, px := range proxies {
						if err := px.RemoveToxic(toxicName); err != nil {
							errs = append(errs, fmt.Errorf("%s: %w", px.Name, err))
						}
					}
					return errors.Join(errs...)
				}})
		}
	}
	return fs
}

// replica returns the replica named name ("toolrunner-b"), or nil.
func (c *Cluster) replica(name string) *meshproc.Proc {
	for _, ps := range c.Replicas {
		for _, p := range ps {
			if p.Name == name {
				return p
			}
		}
	}
	return nil
}

// proxiesOf returns the proxies in front of service's replicas, or only of replica.
func (c *Cluster) proxiesOf(service, replica string) []*toxiproxy.Proxy {
	var out []*toxiproxy.Proxy
	for i, px := range c.proxies[service] {
		if replica == "" || c.Replicas[service][i].Name == replica {
			out = append(out, px)
		}
	}
	return out
}
