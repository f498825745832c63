module github.com/curfew-mesh/curfew

go 1.26.0

require (
	github.com/curfew-mesh/curfew/gen v0.0.0
	golang.org/x/term v0.48.0
	google.golang.org/grpc v1.85.0
	google.golang.org/protobuf v1.36.12
)

require (
	go.uber.org/goleak v1.3.0 // indirect
	golang.org/x/net v0.60.0 // indirect
	golang.org/x/sys v0.50.0 // indirect
	golang.org/x/text v0.42.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260817212433-ac3dfec99bb1 // indirect
)

replace (
	github.com/curfew-mesh/curfew/gen => ./gen
	github.com/curfew-mesh/curfew/mesh => ./mesh
)
