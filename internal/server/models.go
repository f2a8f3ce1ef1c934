package server

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// serveModels answers GET /v1/models with the union of the models of every ready worker, each
// as the card its first worker reported.
func (s *Server) serveModels(w http.ResponseWriter, _ *http.Request) {
	seen := map[string]bool{}
	data := []json.RawMessage{}
	for _, wk := range s.reg.Snapshot().Workers {
		in := wk.Info()
		if in == nil || !wk.Ready() {
			continue
		}
		for _, m := range in.Models {
			if seen[m.ID] {
				continue
			}
			seen[m.ID] = true
			card := m.Card
			if card == nil {
				card, _ = json.Marshal(map[string]any{"id": m.ID, "object": "model", "created": 0, "owned_by": in.Runtime})
			}
			data = append(data, card)
		}
	}
	body, _ := json.Marshal(map[string]any{"object": "list", "data": data})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	_, _ = w.Write(body)
}
