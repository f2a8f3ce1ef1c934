package config

import (
	"fmt"
	"sync"
	"testing"
)

// TestResolveKVConnectorRemembersWithinItsBound: a setting asked again answers what it resolved
// to the first time (errors too), from many goroutines at once, and settings past the bound are
// answered without being kept.
func TestResolveKVConnectorRemembersWithinItsBound(t *testing.T) {
	settings := []string{"NixlConnector", "nixl", "NixlPushConnector", "MooncakeConnectorV1", "", "  Mooncake ", "NoSuchConnector",
		`{"kv_connector":"MultiConnector","kv_connector_extra_config":{"connectors":[{"kv_connector":"NixlConnector"},{"kv_connector":"LMCacheConnectorV1"}]}}`, `{"kv_connector":`}
	for i := range resolvedConnectors.Max + 50 {
		settings = append(settings, fmt.Sprintf("Connector%d", i))
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 2 {
				for _, s := range settings {
					m, v, err := ResolveKVConnector(s)
					wm, wv, werr := resolveKVConnector(s)
					if m != wm || v != wv || fmt.Sprint(err) != fmt.Sprint(werr) {
						t.Errorf("ResolveKVConnector(%q) = %q, %q, %v; resolved afresh: %q, %q, %v", s, m, v, err, wm, wv, werr)
					}
				}
			}
		})
	}
	wg.Wait()
	if n := resolvedConnectors.Len(); n > resolvedConnectors.Max {
		t.Fatalf("%d settings kept, bound %d", n, resolvedConnectors.Max)
	}
	if !resolvedConnectors.Has("NixlConnector") {
		t.Fatal("NixlConnector, asked first, was not kept")
	}
}
