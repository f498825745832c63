// Package drill is `curfew drill`: the cancel-and-shed drill across the real services
// (docs/drill.md). Every task runs one model step decoding past the deadline, whose
// first attempt fails (a sim plan model_error) so that the retry layer retries it with
// the same retry-id; the client cancels every task at Config.CancelAt; after the
// deadline the drill reads each run's summary into a Row per task, and Verdict judges
// the rows. StartMesh starts the drill's own mesh, on package launch.
package drill
