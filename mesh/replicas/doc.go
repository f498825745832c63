// Package replicas reaches every replica of a mesh service, where a gRPC connection
// reaches one of them per call.
//
// A service's calls to another (Execute, Generate, Spawn) are balanced over the callee's
// replicas by gRPC itself: any replica will do. The node reports are different: a run's
// nodes live in the tables of the replicas that executed them, so a cancel broadcast, a
// run's summary (its token figures from each decoder's ledger) and the wait for a
// cancelled subtree's teardown must ask every replica. With Kubernetes' headless
// Services a dns:/// target resolves to every ready pod; Set resolves it (at most once a
// DefaultRefresh, in the background so that no call but the very first waits for DNS,
// keeping the last good answer when a lookup fails) and keeps a
// connection per address, and NodeReports is a NodeReportServiceClient that fans each
// call out to all of them and joins the answers. A target naming its DNS server
// (dns://10.0.0.10:53/curfew-toolrunner:7702) is resolved there, as gRPC's own dns
// resolver does. A target that is not dns:/// (curfew up's
// loopback addresses) is one replica, and NodeReports then behaves as a plain client.
package replicas
