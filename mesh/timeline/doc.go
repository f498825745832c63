// Package timeline lays a run's tree on one time axis: every instant of the run and its
// nodes (start, end, cancel, deadline) in milliseconds from the run's start, with the
// figures `curfew trace` prints beside each node (tokens, tokens after the cancel, time
// left at its end, attempts).
//
// The curfew CLI draws it as text (`curfew trace`) and prints it as JSON
// (`curfew trace --json`, whose schema is Timeline's); the orchestrator's web console
// draws it as SVG. Both take the axis's extent from Span, so the two pictures agree.
package timeline
