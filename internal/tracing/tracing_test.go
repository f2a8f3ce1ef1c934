package tracing

import (
	"context"
	"testing"
)

// smg's form of --otlp-traces-endpoint, host:port (its default localhost:4317), is OTLP over
// gRPC, as in smg; a URL keeps its scheme; anything else is refused.
func TestEndpointForms(t *testing.T) {
	for endpoint, ok := range map[string]bool{"localhost:4317": true, "grpc://127.0.0.1:4317": true, "http://127.0.0.1:4318": true, "://": false} {
		stop, err := Setup(context.Background(), Config{Endpoint: endpoint, Ratio: 1})
		if (err == nil) != ok {
			t.Errorf("%q: %v", endpoint, err)
		}
		if err == nil {
			_ = stop(context.Background())
		}
	}
}
