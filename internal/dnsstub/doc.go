// Package dnsstub is a name server for tests and the soak: it answers A queries for a
// fixed set of names, each with a fixed list of addresses, on a UDP port of 127.0.0.1.
// It stands where a Kubernetes headless Service's DNS stands: one name that resolves to
// every ready replica (127.0.0.1:P, 127.0.0.2:P, ...), which gRPC's dns resolver spreads
// calls over. Any other name gets NXDOMAIN; any other query type an empty answer.
package dnsstub
