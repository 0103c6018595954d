package gang

import (
	"context"
	"fmt"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/dynamic"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// Client reads and writes gangs through the dynamic client (no
// generated clientset: the types are hand-written).
type Client struct {
	dyn dynamic.Interface
}

// NewClient reads and writes gangs through dyn.
func NewClient(dyn dynamic.Interface) Client { return Client{dyn: dyn} }

func (c Client) resource(ns string) dynamic.ResourceInterface {
	return c.dyn.Resource(gangv1.GroupVersionResource).Namespace(ns)
}

// FromUnstructured converts a gang read through the dynamic client.
func FromUnstructured(u *unstructured.Unstructured) (*gangv1.Gang, error) {
	var g gangv1.Gang
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &g); err != nil {
		return nil, fmt.Errorf("decode gang %s/%s: %w", u.GetNamespace(), u.GetName(), err)
	}
	g.APIVersion, g.Kind = gangv1.Group+"/"+gangv1.Version, gangv1.Kind
	return &g, nil
}

func toUnstructured(g *gangv1.Gang) (*unstructured.Unstructured, error) {
	g = g.DeepCopy()
	g.APIVersion, g.Kind = gangv1.Group+"/"+gangv1.Version, gangv1.Kind
	obj, err := runtime.DefaultUnstructuredConverter.ToUnstructured(g)
	if err != nil {
		return nil, fmt.Errorf("encode gang %s/%s: %w", g.Namespace, g.Name, err)
	}
	return &unstructured.Unstructured{Object: obj}, nil
}

// Get reads a gang.
func (c Client) Get(ctx context.Context, ns, name string) (*gangv1.Gang, error) {
	u, err := c.resource(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	return FromUnstructured(u)
}

// List reads every gang in every namespace.
func (c Client) List(ctx context.Context) ([]*gangv1.Gang, error) {
	l, err := c.dyn.Resource(gangv1.GroupVersionResource).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	out := make([]*gangv1.Gang, 0, len(l.Items))
	for i := range l.Items {
		g, err := FromUnstructured(&l.Items[i])
		if err != nil {
			return nil, err
		}
		out = append(out, g)
	}
	return out, nil
}

// Update writes metadata and spec (annotations, finalizers).
func (c Client) Update(ctx context.Context, g *gangv1.Gang) (*gangv1.Gang, error) {
	return c.write(g, func(r dynamic.ResourceInterface, u *unstructured.Unstructured) (*unstructured.Unstructured, error) {
		return r.Update(ctx, u, metav1.UpdateOptions{})
	})
}

// UpdateStatus writes the status.
func (c Client) UpdateStatus(ctx context.Context, g *gangv1.Gang) (*gangv1.Gang, error) {
	return c.write(g, func(r dynamic.ResourceInterface, u *unstructured.Unstructured) (*unstructured.Unstructured, error) {
		return r.UpdateStatus(ctx, u, metav1.UpdateOptions{})
	})
}

// Create writes a new gang.
func (c Client) Create(ctx context.Context, g *gangv1.Gang) (*gangv1.Gang, error) {
	return c.write(g, func(r dynamic.ResourceInterface, u *unstructured.Unstructured) (*unstructured.Unstructured, error) {
		return r.Create(ctx, u, metav1.CreateOptions{})
	})
}

// write sends the gang with one of the dynamic client's writes and decodes
// what the API server returned.
func (c Client) write(g *gangv1.Gang, send func(dynamic.ResourceInterface, *unstructured.Unstructured) (*unstructured.Unstructured, error)) (*gangv1.Gang, error) {
	u, err := toUnstructured(g)
	if err != nil {
		return nil, err
	}
	out, err := send(c.resource(g.Namespace), u)
	if err != nil {
		return nil, err
	}
	return FromUnstructured(out)
}
